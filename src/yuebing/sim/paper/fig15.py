"""Figure 15 (as we read it): prefill and decode load over time, and the TTFT breakdown.

From the global cache-aware Mooncake run (8P+8D, conversation trace at 1×): the sampled prefill
load (mean queued seconds / TTFT SLO) and decode load (KV reserved / capacity), and the mean
TTFT parts (queue, prefill) with the transfer and decode-wait tails.
"""

from __future__ import annotations

from pathlib import Path

from yuebing.sim.paper import fig5
from yuebing.sim.paper.common import pyplot, run, save_figure

PAPER: dict[str, float] | None = None


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, object]:
    res = run(trace_path, fig5.config("global_cache_aware", fast))
    ts = res.timeseries
    return {
        "t_s": [round(t, 3) for t in ts["t_s"]],
        "prefill_load": ts["prefill_load"],
        "decode_load": ts["decode_load"],
        "decode_batch": ts["decode_batch"],
        "breakdown_mean_s": res.summary["breakdown_mean_s"],
    }


def plot(result: dict[str, object], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    t = result["t_s"]
    ax1.plot(t, result["prefill_load"], lw=0.8, label="prefill load")
    ax1.plot(t, result["decode_load"], lw=0.8, label="decode load")
    ax1.set_xlabel("simulated time (s)")
    ax1.set_ylabel("load")
    ax1.legend(fontsize=8)
    parts = result["breakdown_mean_s"]
    assert isinstance(parts, dict)
    ax2.bar([k.removesuffix("_s") for k in parts], list(parts.values()))
    ax2.set_ylabel("mean seconds")
    ax2.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle("Figure 15: load over time and TTFT breakdown (global cache-aware, 8P+8D)")
    return [save_figure(fig, out_dir, "fig15_load_breakdown.png")]
