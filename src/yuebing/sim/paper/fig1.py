"""Figure 1: effective request capacity of Mooncake vs the vLLM baselines at TBT 100/200/300 ms.

16 nodes replay the conversation trace: Mooncake as 8 prefill + 8 decode nodes with global
cache-aware scheduling; each coupled baseline (`yuebing.sim.vllm`: vLLM, + prefix caching,
+ chunked prefill) as 16 instances. Effective capacity = share of all requests with TTFT ≤ 30 s
and TBT (mean of the longest 10 % intervals) ≤ the threshold.
"""

from __future__ import annotations

from pathlib import Path

from yuebing.sim.metrics import capacity_curve
from yuebing.sim.paper.common import fast_config, pyplot, run
from yuebing.sim.runner import load_systems
from yuebing.sim.system import SYSTEMS, SimConfig

SYSTEM_NAMES = ("mooncake", "vllm", "vllm_prefix_caching", "vllm_chunked_prefill")
THRESHOLDS_MS = (100, 200, 300)
PAPER: dict[str, dict[str, float] | None] = {
    "mooncake": None,
    "vllm": {"100": 0.16, "200": 0.40, "300": 0.63},
    "vllm_prefix_caching": {"100": 0.15, "200": 0.34, "300": 0.56},
    "vllm_chunked_prefill": {"100": 0.09, "200": 0.29, "300": 0.54},
}
"""Paper Figure 1 (the issue's reading of it); Mooncake's bars are only bounded by the issue's
target (≥ 90 % at 100 ms, ≥ 98 % at 200/300 ms), not given as numbers."""


def config(system: str, fast: bool = False) -> SimConfig:
    return fast_config(SimConfig(system=system, prefill_nodes=8, decode_nodes=8), fast)


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, dict[str, float] | None]:
    """{system: {"100": share, "200": share, "300": share}}; None for a system not built."""
    load_systems()
    out: dict[str, dict[str, float] | None] = {}
    for name in SYSTEM_NAMES:
        if name not in SYSTEMS:
            out[name] = None
            continue
        records = run(trace_path, config(name, fast)).records
        curve = capacity_curve(records, [ms / 1000 for ms in THRESHOLDS_MS])
        out[name] = {str(ms): share for ms, (_, share) in zip(THRESHOLDS_MS, curve, strict=True)}
    return out


def plot(result: dict[str, dict[str, float] | None], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for k, name in enumerate(SYSTEM_NAMES):
        ours = result.get(name)
        if ours is None:
            continue
        xs = [i + (k - 1.5) * width for i in range(len(THRESHOLDS_MS))]
        bars = ax.bar(xs, [100 * ours[str(t)] for t in THRESHOLDS_MS], width, label=name)
        paper = PAPER.get(name)
        if paper:
            ax.scatter(xs, [100 * paper[str(t)] for t in THRESHOLDS_MS], marker="_", s=300,
                       color="black", zorder=3, label="paper" if k == 1 else None)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(THRESHOLDS_MS)), [f"TBT ≤ {t} ms" for t in THRESHOLDS_MS])
    ax.set_ylabel("effective request capacity (%)")
    ax.set_ylim(0, 110)
    ax.set_title("Figure 1: effective request capacity (16 nodes, conversation)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(out_dir) / "fig1_effective_capacity.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
