"""yuebing.trace: Mooncake traces — load/validate, stats, transforms, synthetic workloads,
prompt synthesis and prefix-cache hit-rate replay. See docs/structure.md ("Traces").

Life cycle of a request here: a JSONL line is decoded into a frozen `Request` (`io`), held in an
immutable `Trace`; transforms (`transform`, `synth`) return new traces; consumers replay it in
timestamp order (`hitrate`, the simulator, the live bench with `prompts` token ids).
"""

from yuebing.trace.hitrate import ROUTERS, HitRateResult, PrefixLRU, simulate_global, simulate_local
from yuebing.trace.io import load_trace, write_trace
from yuebing.trace.model import BLOCK_SIZE, Request, Trace
from yuebing.trace.prompts import PromptSynthesizer
from yuebing.trace.stats import TraceStats, trace_stats

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
