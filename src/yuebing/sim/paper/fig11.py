"""Figure 11: replicas of hot KV blocks over time (conversation trace).

In the global cache-aware Mooncake run of Figure 5 (8P+8D), a prefix fetch copies the blocks to
the fetching node, so hot blocks gain replicas (paper §4.2). We follow the blocks ranked 10th,
100th, 1,000th and 10,000th by the number of requests using them
(`yuebing.sim.mooncake.TRACKED_RANKS`) and sample how many prefill nodes hold each every
`SAMPLE_S` seconds. The paper plots the same ranks every 30 s; its maximum (8) is the number of
prefill nodes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from yuebing.sim.paper import fig5
from yuebing.sim.paper.common import pyplot, run, save_figure
from yuebing.sim.system import SimConfig

SAMPLE_S = 30.0
PAPER: dict[str, dict[str, dict[str, float | None]]] = {"by_rank": {
    "10": {"max_replicas": 8, "first_at_max_s": 1100},
    "100": {"max_replicas": 7, "first_at_max_s": 2400},
    "1000": {"max_replicas": 6, "first_at_max_s": 700},
    "10000": {"max_replicas": 3, "first_at_max_s": None},
}}
"""Paper Figure 11 (read off the plot): the most replicas each rank reaches and when."""


def config(fast: bool = False) -> SimConfig:
    return replace(fig5.config("global_cache_aware", fast), sample_interval_s=SAMPLE_S)


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, object]:
    """{"replicas": {rank: series}, "t_s": sample times, per rank "max_replicas" and
    "first_at_max_s"}."""
    res = run(trace_path, config(fast))
    t = [round(x, 1) for x in res.timeseries["t_s"]]
    series = res.extra["ranked_key_replicas"]
    assert isinstance(series, dict)
    summary: dict[str, dict[str, float | None]] = {}
    for rank, values in series.items():
        top = max(values) if values else 0
        summary[rank] = {"max_replicas": top,
                         "first_at_max_s": t[values.index(top)] if values else None}
    return {"by_rank": summary, "t_s": t, "replicas": series}


def plot(result: dict[str, object], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    t = result["t_s"]
    series = result["replicas"]
    assert isinstance(series, dict) and isinstance(t, list)
    fig, ax = plt.subplots(figsize=(8, 4))
    for rank, values in series.items():
        ax.plot(t[:len(values)], values, lw=0.9, label=f"{int(rank):,}th hottest block")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas (prefill nodes holding it)")
    ax.set_title("Figure 11: replicas of hot blocks over time (global cache-aware, 8P+8D)")
    ax.legend(fontsize=7)
    return [save_figure(fig, out_dir, "fig11_hot_replicas.png")]
