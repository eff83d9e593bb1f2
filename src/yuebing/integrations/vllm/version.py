"""Which vLLM versions `YuebingConnector` supports, and the one-line refusal of any other
(`require_connector_api`, called by `connector` before it imports vLLM's connector API)."""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

SUPPORTED = ("0.32",)
"""vLLM release series the connector is built and tested against (``make test-vllm``)."""

API_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
API_NAMES = ("KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole")


class UnsupportedVllm(ImportError):
    """This vLLM has no KV connector API the connector can use."""


def supported(version: str) -> bool:
    return any(version == s or version.startswith(s + ".") for s in SUPPORTED)


def refusal(version: str, missing: str) -> str:
    return (f"yuebing's vLLM connector needs vLLM's KVConnectorBase_V1 API (supported vLLM: "
            f"{', '.join(s + '.x' for s in SUPPORTED)}); vLLM {version} lacks {missing}")


def require_connector_api() -> None:
    """Raise `UnsupportedVllm` (one line naming the supported versions) unless vLLM and its
    ``KVConnectorBase_V1`` API import; warn on a version the connector was not tested with."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as e:
        raise UnsupportedVllm(refusal("(not installed)", f"the vllm package ({e})")) from None
    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        api = importlib.import_module(API_MODULE)
    except ImportError:
        raise UnsupportedVllm(refusal(version, API_MODULE)) from None
    missing = [n for n in API_NAMES if not hasattr(api, n)]
    if missing:
        raise UnsupportedVllm(refusal(version, ", ".join(missing)))
    if not supported(version):
        log.warning("yuebing's vLLM connector is tested with vLLM %s, this is %s",
                    ", ".join(s + ".x" for s in SUPPORTED), version)
