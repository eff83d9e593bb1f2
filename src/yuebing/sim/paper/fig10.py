"""Figure 10 (as we read it): replicas of the hottest KV blocks over time.

In the global cache-aware Mooncake run (8P+8D, conversation trace) every prefix fetch copies
blocks to the fetching node, so hot blocks gain replicas (paper §4.2). We follow the trace's
ten most shared prefixes (the most used block of each; `yuebing.sim.mooncake.hot_prefixes`) and
sample how many prefill nodes hold each one every 10 s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from yuebing.sim.paper import fig5
from yuebing.sim.paper.common import pyplot, run, save_figure

PAPER: dict[str, float] | None = None


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, object]:
    res = run(trace_path, fig5.config("global_cache_aware", fast))
    series = res.extra["hot_key_replicas"]
    assert isinstance(series, dict)
    return {
        "t_s": [round(t, 3) for t in res.timeseries["t_s"]],
        "replicas": series,
        "mean_replicas": {k: float(np.mean(v)) if v else 0.0 for k, v in series.items()},
        "max_replicas": {k: int(max(v)) if v else 0 for k, v in series.items()},
    }


def plot(result: dict[str, object], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    t = result["t_s"]
    series = result["replicas"]
    assert isinstance(series, dict) and isinstance(t, list)
    fig, ax = plt.subplots(figsize=(8, 4))
    for key, values in series.items():
        ax.plot(t[:len(values)], values, lw=0.8, label=f"block {key}")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas (prefill nodes holding it)")
    ax.set_title("Figure 10: replicas of the 10 hottest prefixes (global cache-aware)")
    ax.legend(fontsize=6, ncol=2)
    return [save_figure(fig, out_dir, "fig10_hot_replicas.png")]
