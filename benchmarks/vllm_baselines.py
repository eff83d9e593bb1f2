"""Benchmark: the coupled vLLM baselines vs Mooncake on the conversation trace (Figure 1 setting),
with the simulation speed of each run and a sensitivity sweep over the roofline's prefill MFU.

For each prefill MFU given (the roofline's ``NodeSpec.mfu``, the asymptote of its efficiency
curve MFU(t) = mfu · t / (t + 256) for a pass over t tokens; 0.62 is the simulator default),
simulates the whole trace on 16 nodes (Mooncake 8P+8D with global cache-aware scheduling; each
baseline as 16 coupled instances) and reports effective request capacity at TBT 100/200/300 ms
next to the paper's Figure 1, the mean TTFT, the hit rate, wall time and events/s. The plot shows
capacity per system and MFU with the paper's values as black ticks.

Sensitivity rows (printed and in the JSON, not plotted): ``--chunk-budget 2048`` adds chunked
prefill with that token budget (vLLM's default since PR #10544, Nov 2024; 512 before), and
``--cached-attention-efficiency 0.5,0.1`` adds prefix caching and chunked prefill with attention
over cached KV at that fraction of the pass's efficiency (vLLM 0.5's Triton prefix-prefill
kernel; `yuebing.sim.vllm_cost`).

    .venv/bin/python benchmarks/vllm_baselines.py --mfu 0.62 --speed 1.75 \\
        --plot docs/img/vllm_baselines.png --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, TaskID

from yuebing.sim.hardware import NodeSpec, RooflineCostModel
from yuebing.sim.runner import simulate
from yuebing.sim.system import SimConfig
from yuebing.sim.vllm import VARIANTS, VllmOptions, register_variant
from yuebing.sim.workload import load_requests

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
SYSTEMS = ("mooncake", "vllm", "vllm_prefix_caching", "vllm_chunked_prefill")
PAPER = {"vllm": (0.16, 0.40, 0.63), "vllm_prefix_caching": (0.15, 0.34, 0.56),
         "vllm_chunked_prefill": (0.09, 0.29, 0.54)}


def sensitivity_variants(budgets: list[int], efficiencies: list[float]) -> list[str]:
    """Register the sensitivity variants; their system names."""
    names: list[str] = []
    for budget in budgets:
        names.append(f"vllm_chunked_prefill@budget={budget}")
        register_variant(names[-1], VllmOptions(chunked_prefill=True,
                                                max_num_batched_tokens=budget))
    for eff in efficiencies:
        for base in ("vllm_prefix_caching", "vllm_chunked_prefill"):
            names.append(f"{base}@cached_attention_efficiency={eff:g}")
            opts = dataclasses.replace(VARIANTS[base], cached_attention_efficiency=eff)
            register_variant(names[-1], opts)
    return names


def _advance(bar: Progress, task: TaskID, done: int) -> None:
    bar.update(task, completed=done)


def run_all(trace: Path, mfus: list[float], speed: float,
            extra: list[str] | None = None) -> list[dict[str, object]]:
    requests = load_requests(trace, speed=speed)
    rows: list[dict[str, object]] = []
    with Progress(console=Console(stderr=True)) as bar:
        for mfu in mfus:
            cost = RooflineCostModel(node=NodeSpec(mfu=mfu))
            for system in (*SYSTEMS, *(extra or [])):
                task = bar.add_task(f"{system} mfu={mfu}", total=len(requests))
                t0 = time.perf_counter()
                result = simulate(requests, SimConfig(system=system), cost=cost,
                                  progress=partial(_advance, bar, task))
                wall = time.perf_counter() - t0
                s = result.summary
                rows.append({
                    "system": system, "mfu": mfu, "speed": speed,
                    "capacity": s["effective_capacity"],
                    "paper": dict(zip(("100", "200", "300"), PAPER[base], strict=True))
                    if (base := system.split("@")[0]) in PAPER else None,
                    "ttft_mean_s": s["ttft_s"]["mean"],  # type: ignore[index]
                    "hit_rate": s["hit_rate"], "wall_s": wall, "events": result.events,
                    "events_per_s": result.events / result.wall_s,
                })
    return rows


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mfus = sorted({float(r["mfu"]) for r in rows}, reverse=True)  # type: ignore[arg-type]
    fig, axes = plt.subplots(1, len(mfus), figsize=(6 * len(mfus), 4), squeeze=False)
    for ax, mfu in zip(axes[0], mfus, strict=True):
        for k, system in enumerate(SYSTEMS):
            row = next(r for r in rows if r["system"] == system and r["mfu"] == mfu)
            cap = row["capacity"]
            xs = [t + (k - 1.5) * 0.2 for t in range(3)]
            bars = ax.bar(xs, [100 * cap[t] for t in ("100", "200", "300")], 0.2,  # type: ignore[index]
                          label=system)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
            if system in PAPER:
                ax.scatter(xs, [100 * v for v in PAPER[system]], marker="_", s=250, color="black",
                           zorder=3, label="paper" if k == 1 else None)
        ax.set_xticks(range(3), ["TBT ≤ 100 ms", "≤ 200 ms", "≤ 300 ms"])
        ax.set_ylim(0, 110)
        ax.set_ylabel("effective request capacity (%)")
        ax.set_title(f"16 nodes, conversation trace, prefill MFU {mfu}")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--mfu", default="0.62", help="comma-separated prefill MFUs of the roofline")
    ap.add_argument("--speed", type=float, default=1.75,
                    help="trace replay speed (Figure 1 uses 1.75)")
    ap.add_argument("--chunk-budget", default="",
                    help="comma-separated extra chunked-prefill token budgets (sensitivity rows)")
    ap.add_argument("--cached-attention-efficiency", default="",
                    help="comma-separated efficiencies of attention over cached KV in (0, 1] "
                         "(sensitivity rows for prefix caching and chunked prefill)")
    ap.add_argument("--plot", type=Path, help="write the capacity plot (PNG) here")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ns = ap.parse_args()
    extra = sensitivity_variants([int(b) for b in ns.chunk_budget.split(",") if b],
                                 [float(e) for e in ns.cached_attention_efficiency.split(",") if e])
    rows = run_all(ns.trace, [float(m) for m in ns.mfu.split(",")], ns.speed, extra)
    if ns.plot:
        plot(rows, ns.plot)
    if ns.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        cap = r["capacity"]
        print(f"{r['system']:48s} mfu={r['mfu']:<5} capacity 100/200/300 ms = "
              + "/".join(f"{100 * cap[t]:.0f}" for t in ("100", "200", "300"))  # type: ignore[index]
              + f" %  mean TTFT {r['ttft_mean_s']:.2f} s  {r['wall_s']:.1f} s wall  "
              f"{r['events_per_s']:,.0f} events/s")


if __name__ == "__main__":
    main()
