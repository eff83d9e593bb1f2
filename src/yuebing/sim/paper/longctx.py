"""arXiv §8.1: long-context throughput on 4 nodes, Mooncake 3P+1D vs vLLM on 4 coupled nodes;
run by `yuebing sim paper`.

Workloads from `yuebing.trace.synth` (Poisson arrivals): ``fixed_16k`` … ``fixed_128k`` (half
of each prompt one shared prefix), ``arxiv_summarization`` (8,088 tokens, nothing shared) and
``l_eval`` (5 documents × 20 questions). For each, `max_rate` searches the largest rate at which
P90 TTFT ≤ 10× and P90 TBT ≤ 5× the system's own no-load values; the paper reports Mooncake's
gain in that rate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from yuebing.sim.paper.common import pyplot, save_figure
from yuebing.sim.runner import simulate
from yuebing.sim.system import SimConfig
from yuebing.sim.workload import SimRequest, from_trace_requests
from yuebing.trace.synth import synthesize

SYSTEMS = {"mooncake": SimConfig(system="mooncake", prefill_nodes=3, decode_nodes=1),
           "vllm": SimConfig(system="vllm", prefill_nodes=3, decode_nodes=1)}
WORKLOADS: dict[str, tuple[str, dict[str, object]]] = {
    **{f"fixed_{n // 1024}k": ("fixed", {"input_tokens": n, "output_tokens": 512,
                                         "shared_fraction": 0.5})
       for n in (16384, 32768, 65536, 131072)},
    "arxiv_summarization": ("fixed", {"input_tokens": 8088, "output_tokens": 229,
                                      "shared_fraction": 0.0}),
    "l_eval": ("docqa", {"documents": 5, "questions_per_document": 20,
                         "min_document_tokens": 18891, "max_document_tokens": 18891,
                         "question_tokens": 128, "output_tokens": 72}),
}
PAPER: dict[str, dict[str, float | None]] = {
    **{f"fixed_{k}k": {"gain": None} for k in (16, 32, 64, 128)},
    "arxiv_summarization": {"gain": 0.20}, "l_eval": {"gain": 0.40}}
"""arXiv §8.1: Mooncake's gain in the largest request rate meeting the SLOs (+20 % ArXiv
Summarization, +40 % L-Eval); for the fixed lengths only the range +50 % … +525 % is given."""
PAPER_FIXED_RANGE = (0.50, 5.25)
REQUESTS = 240
TTFT_FACTOR, TBT_FACTOR = 10.0, 5.0
STEPS = 5
"""Bisection steps of the rate search (after bracketing)."""


def workload(name: str, rate: float, fast: bool = False) -> list[SimRequest]:
    """``fixed_16k`` … ``fixed_128k``: every prompt 16k–128k tokens, its first half one shared
    prefix, output 512 (``synth fixed``); ``arxiv_summarization``: 8,088-token prompts, nothing
    shared, output 229; ``l_eval``: 5 documents of 18,891 tokens each asked 20 questions of 128
    tokens (99 % of the blocks shared), output 72 (``synth docqa``)."""
    kind, params = WORKLOADS[name]
    n = REQUESTS // 2 if fast else REQUESTS
    if kind == "fixed":
        params = {**params, "requests": n}
    trace = synthesize(kind, **params, rate_per_s=rate)
    return from_trace_requests(trace.in_time_order())


def _p90s(config: SimConfig, reqs: list[SimRequest]) -> tuple[float, float]:
    """(P90 TTFT, P90 TBT): the TBT of a request is here the P90 of its token intervals (the
    arXiv's TBT_P90 is over tokens; the FAST paper's mean of the longest 10 % would let one
    prefill stall in 512 tokens fail a request)."""
    records = [r for r in simulate(reqs, config).records if r.rejected is None]
    ttft = np.percentile([r.ttft_s for r in records], 90)
    tbt = np.percentile([r.tbt_p90_s for r in records], 90)
    return float(ttft), float(tbt)


def max_rate(name: str, system: str, fast: bool = False) -> dict[str, float]:
    """The largest rate (requests/s) meeting the SLOs, and the no-load P90s it is judged by."""
    config = SYSTEMS[system]
    ttft0, tbt0 = _p90s(config, workload(name, 1e-4, fast))

    def ok(rate: float) -> bool:
        ttft, tbt = _p90s(config, workload(name, rate, fast))
        return ttft <= TTFT_FACTOR * ttft0 and tbt <= TBT_FACTOR * tbt0
    lo, hi = 0.0, 0.05
    while ok(hi) and hi < 1e3:
        lo, hi = hi, hi * 2
    for _ in range(STEPS):
        mid = (lo + hi) / 2 if lo else hi / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"rate_per_s": lo, "no_load_ttft_p90_s": ttft0, "no_load_tbt_p90_s": tbt0}


def compute(trace_path: str | Path | None = None,
            fast: bool = False) -> dict[str, dict[str, float | None]]:
    """{workload: {"gain": Mooncake's max rate / vLLM's − 1, "<system>_rate_per_s", and each
    system's no-load P90s}}; the trace is not used."""
    out: dict[str, dict[str, float | None]] = {}
    for name in WORKLOADS:
        row: dict[str, float | None] = {}
        for system in SYSTEMS:
            for key, value in max_rate(name, system, fast).items():
                row[f"{system}_{key}"] = value
        vllm = row["vllm_rate_per_s"]
        row["gain"] = (row["mooncake_rate_per_s"] or 0.0) / vllm - 1 if vllm else None
        out[name] = row
    return out


def plot(result: dict[str, dict[str, float | None]], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    names = list(WORKLOADS)
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(names))
    ax.bar(list(xs), [100 * (result[n]["gain"] or 0.0) for n in names], 0.5, label="yuebing sim")
    known = [(x, n) for x, n in zip(xs, names, strict=True) if PAPER[n]["gain"] is not None]
    ax.scatter([x for x, _ in known], [100 * (PAPER[n]["gain"] or 0.0) for _, n in known],
               marker="_", s=400, color="black", zorder=3, label="paper")
    lo, hi = PAPER_FIXED_RANGE
    ax.axhspan(100 * lo, 100 * hi, xmax=4 / len(names), color="grey", alpha=0.2,
               label="paper: fixed lengths +50 … +525 %")
    ax.set_xticks(list(xs), [n.replace("_", "\n") for n in names])
    ax.set_ylabel("max request rate gain of Mooncake (%)")
    ax.set_title("arXiv §8.1 long context: Mooncake 3P+1D vs vLLM on 4 nodes")
    ax.legend(fontsize=8)
    return [save_figure(fig, out_dir, "longctx_rate_gain.png")]
