"""Benchmark: the arXiv §7 overload experiment on several P/D splits (trace replayed at 2×).

For each cluster given (``--nodes 8+8,8+2,7+2,6+2``) simulates the whole conversation trace with
the three admission policies of `yuebing.sim.paper.overload` (baseline, early rejection,
predictive early rejection; same set-up as ``yuebing sim paper --figure overload``) and reports
rejected requests, prefill GPU seconds and the load oscillation of the prefill and decode pools
(`yuebing.sim.paper.overload.oscillation`: standard deviation and 20–300 s band variance). The
plot shows rejections and prefill-load band variance per cluster and policy.

    .venv/bin/python benchmarks/overload_variants.py --nodes 8+8,8+2,7+2,6+2 \\
        --plot docs/img/overload_variants.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from yuebing.sim.paper import overload
from yuebing.sim.paper.common import run

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


def parse_nodes(text: str) -> list[tuple[int, int]]:
    """``"8+8,8+2"`` → [(8, 8), (8, 2)]."""
    out = []
    for item in text.split(","):
        p, _, d = item.partition("+")
        if not (p.isdigit() and d.isdigit()):
            raise SystemExit(f"--nodes: {item!r} is not PREFILL+DECODE, e.g. 8+2")
        out.append((int(p), int(d)))
    return out


def run_all(trace: Path, clusters: list[tuple[int, int]]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with Progress(console=Console(stderr=True)) as bar:
        task = bar.add_task("overload runs", total=len(clusters) * len(overload.ADMISSIONS))
        for nodes in clusters:
            for name in overload.ADMISSIONS:
                res = run(trace, overload.config(name, False, nodes))
                row: dict[str, object] = {"cluster": f"{nodes[0]}P+{nodes[1]}D",
                                          "policy": name,
                                          "rejected": res.summary["rejected"],
                                          "prefill_gpu_s": res.summary["prefill_gpu_s"]}
                for pool in ("prefill", "decode"):
                    osc = overload.oscillation(res.timeseries[f"{pool}_load"])
                    row[f"{pool}_load_std"] = osc["std"]
                    row[f"{pool}_load_band_var"] = osc["band_var"]
                rows.append(row)
                bar.advance(task)
    return rows


def plot(rows: list[dict[str, object]], path: Path) -> None:
    from yuebing.sim.paper.common import pyplot

    plt = pyplot()
    clusters = list(dict.fromkeys(str(r["cluster"]) for r in rows))
    names = list(overload.ADMISSIONS)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for k, name in enumerate(names):
        xs = [i + (k - 1) * 0.27 for i in range(len(clusters))]
        by = {str(r["cluster"]): r for r in rows if r["policy"] == name}
        for ax, key in zip(axes, ("rejected", "prefill_load_band_var"), strict=True):
            ax.bar(xs, [float(by[c][key]) for c in clusters], 0.27,  # type: ignore[arg-type]
                   label=name.replace("_", " "))
    for ax, label in zip(axes, ("rejected requests", "prefill load variance, 20-300 s periods"),
                         strict=True):
        ax.set_xticks(range(len(clusters)), clusters)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("Overload (trace ×2): rejections and prefill-load oscillation per P/D split")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--nodes", default="8+8,8+2,7+2,6+2",
                    help="comma-separated PREFILL+DECODE clusters")
    ap.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ns = ap.parse_args()
    rows = run_all(ns.trace, parse_nodes(ns.nodes))
    if ns.plot:
        plot(rows, ns.plot)
    if ns.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"{r['cluster']:6s} {r['policy']:28s} rejected {r['rejected']:5d}  prefill GPU "
              f"{r['prefill_gpu_s']:8.0f} s  prefill load std {r['prefill_load_std']:.3f} "
              f"band {r['prefill_load_band_var']:.4f}  decode load std "
              f"{r['decode_load_std']:.3f} band {r['decode_load_band_var']:.4f}")


if __name__ == "__main__":
    main()
