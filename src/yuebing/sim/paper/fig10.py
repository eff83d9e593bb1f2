"""Figure 10: global vs local KV cache on 10 prefill nodes (conversation trace).

Mooncake with 10 prefill nodes (and one decode node), every request's output cut to one token
(prefill only), 3 M tokens of KV pool per node, replays the conversation trace twice: *local* —
each node reuses only its own cache and the scheduler prefers the node with the longest local
prefix (the shared policy's ``local_cache_aware`` selector); *global* — one pool over all nodes,
a prefix held elsewhere is fetched (and so replicated) when it pays (``global_cache_aware``).
Reported: the token hit rate and the prefill GPU seconds per request.
"""

from __future__ import annotations

from pathlib import Path

from yuebing.sim.paper.common import fast_config, pyplot, run, save_figure
from yuebing.sim.system import SimConfig, sim_policy

MODES = {"local": "local_cache_aware", "global": "global_cache_aware"}
PAPER = {"local": {"hit_rate": 0.167, "prefill_gpu_s_per_request": 1.38},
         "global": {"hit_rate": 0.373, "prefill_gpu_s_per_request": 1.05}}
"""Paper Figure 10 (read off the plot)."""
NODES = 10
POOL_TOKENS = 3_000_000


def config(mode: str, fast: bool = False) -> SimConfig:
    return fast_config(SimConfig(system="mooncake", prefill_nodes=NODES, decode_nodes=1,
                                 policy=sim_policy(prefill_selector=MODES[mode]), dram_kv_tokens=POOL_TOKENS,
                                 output_tokens=1), fast)


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, dict[str, float]]:
    """{"local" | "global": {"hit_rate", "prefill_gpu_s_per_request"}}."""
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        s = run(trace_path, config(mode, fast)).summary
        out[mode] = {"hit_rate": float(s["hit_rate"]),  # type: ignore[arg-type]
                     "prefill_gpu_s_per_request":
                         float(s["prefill_gpu_s"]) / int(s["requests"])}  # type: ignore[arg-type, call-overload]
    return out


def plot(result: dict[str, dict[str, float]], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in ((axes[0], "hit_rate", "cache hit rate"),
                           (axes[1], "prefill_gpu_s_per_request", "prefill GPU s / request")):
        xs = range(len(MODES))
        ax.bar([x - 0.2 for x in xs], [result[m][key] for m in MODES], 0.4, label="yuebing sim")
        ax.bar([x + 0.2 for x in xs], [PAPER[m][key] for m in MODES], 0.4, label="paper")
        ax.set_xticks(list(xs), list(MODES))
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("Figure 10: local vs global cache (10 prefill nodes, 3M tokens each, output 1)")
    return [save_figure(fig, out_dir, "fig10_global_vs_local.png")]
