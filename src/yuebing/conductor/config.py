"""`ConductorConfig`: everything ``yuebing serve conductor`` (and `run_conductor`) is told.

Built by the CLI from its flags (`yuebing.core.config.add_config_args`; the policy's own knobs
come from `PolicyConfig`'s flags) or in code by the all-in-one supervisor and tests; validated
once here, so a bad value fails at start with a message naming the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from yuebing.conductor.policy import PolicyConfig
from yuebing.core.auth import TOKEN_HELP, env_cluster_token, is_loopback
from yuebing.core.config import require
from yuebing.protocol.instance import MAX_LOGPROBS, MAX_N


def _h(text: str, **extra: object) -> dict[str, object]:
    return {"help": text, **extra}


@dataclass(frozen=True)
class ConductorConfig:
    """The live Conductor: HTTP front, instances to drive, KV index sources, limits."""

    host: str = field(default="127.0.0.1", metadata=_h(
        "address the HTTP server binds (127.0.0.1: this host only; 0.0.0.0 exposes it)"))
    port: int = field(default=8000, metadata=_h("HTTP port (0 = pick a free one)"))
    instances: tuple[str, ...] = field(default=(), metadata=_h(
        "control addresses of the instances (tcp://host:port)"))
    etcd: str = field(default="", metadata=_h(
        "etcd URL (http://host:2379): find instances (and the store master) there"))
    cluster: str = field(default="default", metadata=_h("cluster name in etcd"))
    conductor_id: str = field(default="conductor-0", metadata=_h(
        "this Conductor's name (sent to instances, published in etcd)"))
    model: str = field(default="smollm2", metadata=_h(
        "model whose tokenizer and chat template the Conductor applies: smollm2 (bundled GGUF), "
        "a .gguf file, a Hugging Face directory, or dummy[:...] (token-id prompts only)"))
    served_model_name: str = field(default="", metadata=_h(
        "model name clients send ('' = smollm2-135m-instruct for smollm2, else the model "
        "spec)"))
    store_events: str = field(default="", metadata=_h(
        "ZeroMQ address of the store master's KV-event stream ('' = no store index)"))
    store_admin: str = field(default="", metadata=_h(
        "store master admin URL (http://127.0.0.1:PORT): seed and resync the store index from "
        "/keys ('' = follow events only)"))
    predictors: str = field(default="", metadata=_h(
        "predictor file from `yuebing profile`, checked against each instance's engine "
        "configuration ('' = fitted to the instances' start-up profiles; the two rates below "
        "until one arrives)"))
    predictor_check: str = field(default="refuse", metadata=_h(
        "an instance whose engine configuration differs from the one the predictors hold for: "
        "refuse it, or warn and route to it (heterogeneous hosts)"))
    predictor_online: bool = field(default=True, metadata=_h(
        "scale the prefill predictor live by how long finished prefills took against their "
        "estimates (an EWMA; /health shows the scale)"))
    learn_decode_durations: bool = field(default=True, metadata=_h(
        "predictive early rejection: learn the decode durations the forecast assumes from the "
        "finished requests (first token to last) instead of keeping --decode-durations-s"))
    learn_tbt_tail: bool = field(default=True, metadata=_h(
        "learn the policy's TBT tail (a request's paper TBT per predicted mean step, its "
        "--tbt-tail-quantile over recent finished requests) instead of keeping --tbt-tail"))
    tbt_tail_quantile: float = field(default=0.9, metadata=_h(
        "the quantile of paper TBT / predicted step the learned tail is (0 < q ≤ 1; the "
        "default is the SLO attainment target, 0.5 the median)"))
    persist_learned: bool = field(default=True, metadata=_h(
        "keep the TBT tail, decode durations and prefill scale learned online in a file per "
        "cluster configuration (model, instances' engine configurations, machine, predictors, "
        "decode selector), "
        "so a restarted Conductor on the same configuration starts from them; a file of "
        "another configuration or a corrupt one is refused (logged) and relearned"))
    learned_dir: str = field(default="", metadata=_h(
        "where the learned state is kept ('' = $YUEBING_LEARNED_DIR, else "
        "$XDG_CACHE_HOME/yuebing/learned)"))
    learned_save_s: float = field(default=30.0, metadata=_h(
        "write the learned state at most once per this many seconds (and at a configuration "
        "change and at shutdown)"))
    prefill_tokens_per_s: float = field(default=2000.0, metadata=_h(
        "prefill speed assumed without a predictor file (tokens/s)"))
    decode_step_s: float = field(default=0.03, metadata=_h(
        "decode step time assumed without a predictor file (s)"))
    link_bandwidth_Bps: float = field(default=2e9, metadata=_h(
        "bandwidth of one KV transfer between instances or from the store (bytes/s)"))
    link_latency_s: float = field(default=0.0005, metadata=_h("latency of one KV transfer (s)"))
    kv_bytes_per_token: int = field(default=0, metadata=_h(
        "KV bytes per token the policy charges transfers for (0 = from the model's shape)"))
    store_block_tokens: int = field(default=256, metadata=_h(
        "tokens per store block (must match the instances' --store-block-tokens)"))
    heartbeat_timeout_s: float = field(default=2.0, metadata=_h(
        "an instance with no load report for this long leaves the view"))
    rpc_timeout_s: float = field(default=5.0, metadata=_h(
        "longest wait for an instance's reply to one control call (s)"))
    prefill_gate_tokens: int = field(default=2048, metadata=_h(
        "uncached prompt tokens a prefill instance is given at once; further requests wait in "
        "the Conductor, holding no decode KV, and reserve it when their turn comes (0 = no "
        "queue here: reserve and submit at once)"))
    reserve_wait_s: float = field(default=10.0, metadata=_h(
        "how long a request whose turn came waits for free KV on its decode instance before "
        "it is refused with 429 (s)"))
    request_timeout_s: float = field(default=600.0, metadata=_h(
        "longest a request may run end to end before it is cancelled (s)"))
    max_body_bytes: int = field(default=4 << 20, metadata=_h(
        "largest request body accepted (bytes)", size=True))
    max_prompt_tokens: int = field(default=0, metadata=_h(
        "longest prompt accepted in tokens (0 = the instances' context length)"))
    max_tokens_cap: int = field(default=4096, metadata=_h(
        "largest max_tokens a request may ask for (also the default when it asks none)"))
    max_n: int = field(default=8, metadata=_h(
        "largest n (choices per prompt, sharing one prefill) a request may ask for"))
    max_logprobs: int = field(default=20, metadata=_h(
        "most top logprobs per token a request may ask for (chat top_logprobs, completions "
        "logprobs; at most 20)"))
    max_prompts: int = field(default=64, metadata=_h(
        "most prompts in one /v1/completions prompt list"))
    max_concurrent: int = field(default=256, metadata=_h(
        "most requests in flight at once; more get HTTP 429"))
    api_key: str = field(default="", metadata=_h(
        "require 'Authorization: Bearer KEY' on /v1/* ('' = no authentication; required "
        "when --host is not a loopback address)"), repr=False)
    cluster_token: str = field(default_factory=env_cluster_token, repr=False, metadata=_h(
        TOKEN_HELP + "; presented to the instances' control sockets", secret=True))
    access_log: bool = field(default=True, metadata=_h(
        "log one line per request with its timing breakdown"))
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(block_tokens=256))

    def __post_init__(self) -> None:
        require(1 <= len(self.host) <= 255, "--host must name an address")
        require(0 <= self.port <= 65535, f"--port must be in 0..65535, got {self.port}")
        require(self.predictor_check in ("refuse", "warn"),
                f"--predictor-check must be refuse or warn, got {self.predictor_check!r}")
        require(bool(self.api_key) or is_loopback(self.host),
                f"--host {self.host!r} exposes the HTTP API beyond this host: set --api-key "
                "(clients then send 'Authorization: Bearer KEY') or bind 127.0.0.1")
        for a in self.instances:
            require(a.startswith(("tcp://", "ipc://")) and len(a) > 6,
                    f"--instances: {a!r} is not a control address like tcp://127.0.0.1:5601")
        require(not self.etcd or self.etcd.startswith(("http://", "https://")),
                f"--etcd must be an URL like http://127.0.0.1:2379, got {self.etcd!r}")
        require(bool(self.model), "--model must name a model")
        require(not self.store_admin or self.store_admin.startswith("http://"),
                f"--store-admin must be an URL like http://127.0.0.1:8081, got "
                f"{self.store_admin!r}")
        for name in ("prefill_tokens_per_s", "decode_step_s", "link_bandwidth_Bps",
                     "heartbeat_timeout_s", "rpc_timeout_s", "request_timeout_s",
                     "reserve_wait_s", "learned_save_s"):
            v = getattr(self, name)
            require(math.isfinite(v) and v > 0,
                    f"--{name.replace('_', '-')} must be a positive number, got {v}")
        require(not self.learned_dir or not Path(self.learned_dir).exists()
                or Path(self.learned_dir).is_dir(),
                f"--learned-dir {self.learned_dir} exists and is not a directory")
        require(0 < self.tbt_tail_quantile <= 1,
                f"--tbt-tail-quantile must be in (0, 1], got {self.tbt_tail_quantile}")
        require(math.isfinite(self.link_latency_s) and self.link_latency_s >= 0,
                f"--link-latency-s must be >= 0, got {self.link_latency_s}")
        for name, least in (("kv_bytes_per_token", 0), ("store_block_tokens", 1),
                            ("prefill_gate_tokens", 0),
                            ("max_body_bytes", 1024), ("max_prompt_tokens", 0),
                            ("max_tokens_cap", 1), ("max_concurrent", 1), ("max_n", 1),
                            ("max_logprobs", 0), ("max_prompts", 1)):
            v = getattr(self, name)
            require(v >= least, f"--{name.replace('_', '-')} must be >= {least}, got {v}")
        require(self.max_logprobs <= MAX_LOGPROBS and self.max_n <= MAX_N,
                f"--max-logprobs must be <= {MAX_LOGPROBS} and --max-n <= {MAX_N} (what the "
                f"engine computes), got {self.max_logprobs} and {self.max_n}")
        require(self.policy.block_tokens == self.store_block_tokens,
                f"the policy's block_tokens ({self.policy.block_tokens}) must equal "
                f"--store-block-tokens ({self.store_block_tokens}): the KV index keys are "
                "store blocks")

    @property
    def model_name(self) -> str:
        """The name clients put in ``model``."""
        if self.served_model_name:
            return self.served_model_name
        return "smollm2-135m-instruct" if self.model == "smollm2" else self.model
