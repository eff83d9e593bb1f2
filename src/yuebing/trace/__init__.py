"""yuebing.trace: Mooncake traces — load/validate, stats, transforms, synthetic workloads,
prompt synthesis and prefix-cache hit-rate replay. See docs/structure.md ("Traces").

Life cycle of a request here: a JSONL line is decoded into a frozen `Request` (`io`), held in an
immutable `Trace`; transforms (`transform`, `synth`) return new traces; consumers replay it in
timestamp order (`hitrate`, the simulator, the live bench with `prompts` token ids).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BLOCK_SIZE": "model", "Request": "model", "Trace": "model",
    "load_trace": "io", "write_trace": "io",
    "TraceStats": "stats", "trace_stats": "stats",
    "PromptSynthesizer": "prompts",
    "ROUTERS": "hitrate", "HitRateResult": "hitrate", "PrefixLRU": "hitrate",
    "simulate_global": "hitrate", "simulate_local": "hitrate",
}


def __getattr__(name: str) -> Any:
    """Lazy re-exports, so importing one submodule (e.g. for CLI flags) stays cheap."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'yuebing.trace' has no attribute {name!r}")
    return getattr(importlib.import_module(f"yuebing.trace.{module}"), name)


__all__ = [
    "BLOCK_SIZE",
    "ROUTERS",
    "HitRateResult",
    "PrefixLRU",
    "PromptSynthesizer",
    "Request",
    "Trace",
    "TraceStats",
    "load_trace",
    "simulate_global",
    "simulate_local",
    "trace_stats",
    "write_trace",
]
