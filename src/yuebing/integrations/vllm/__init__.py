"""vLLM under yuebing: `YuebingConnector`, a vLLM KV connector (``KVConnectorBase_V1``) that
loads prefix KV from the yuebing store and saves new full blocks to it, with the same block keys
as yuebing's own instances and the Conductor; and `instance.VllmInstance`, which makes a vLLM
server an instance of the Conductor (``yuebing vllm instance``, ``yuebing serve --engine vllm``).

vLLM loads the connector by module path (``kv_connector_module_path``:
``yuebing.integrations.vllm.connector``); only that module imports vLLM. The other modules are
plain Python and torch (`layout`: geometry, fingerprint and keys; `plan`: which vLLM blocks load
from and save to which store objects; `config`; `version`; `scheduler` and `worker`: the two
halves of the connector; `instance`, `handoff`, `load`, `run`, `server`: the Conductor's side),
so they are tested without vLLM.
"""
