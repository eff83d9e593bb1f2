"""Figure 11 (as we read it): effective request capacity as a curve of the TBT threshold.

The same four 16-node runs as Figure 1 (trace replayed at `fig1.SPEED`), evaluated at TBT thresholds from 25 ms to 500 ms
(TTFT ≤ 30 s throughout).
"""

from __future__ import annotations

from pathlib import Path

from yuebing.sim.metrics import capacity_curve
from yuebing.sim.paper import fig1
from yuebing.sim.paper.common import pyplot, run, save_figure
from yuebing.sim.runner import load_systems
from yuebing.sim.system import SYSTEMS

THRESHOLDS_MS = (25, 50, 75, 100, 150, 200, 250, 300, 400, 500)
PAPER: dict[str, float] | None = None


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, list[list[float]] | None]:
    load_systems()
    out: dict[str, list[list[float]] | None] = {}
    for name in fig1.SYSTEM_NAMES:
        if name not in SYSTEMS:
            out[name] = None
            continue
        records = run(trace_path, fig1.config(name, fast)).records
        curve = capacity_curve(records, [t / 1000 for t in THRESHOLDS_MS])
        out[name] = [[round(t * 1000), share] for t, share in curve]
    return out


def plot(result: dict[str, list[list[float]] | None], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in result.items():
        if curve:
            ax.plot([c[0] for c in curve], [100 * c[1] for c in curve], marker="o", label=name)
    ax.set_xlabel("TBT threshold (ms)")
    ax.set_ylabel("effective request capacity (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Figure 11: effective capacity vs TBT threshold (16 nodes)")
    ax.legend(fontsize=8)
    return [save_figure(fig, out_dir, "fig11_capacity_curve.png")]
