"""``yuebing bench sim``: how fast the simulator replays a whole trace, per system.

Life cycle: `run_bench` loads the trace once, then for each system simulates it ``repeat``
times on one core (the simulator is single-threaded) and keeps the fastest wall time; it
reports wall and CPU seconds (the machine is shared, so CPU seconds are the steadier
figure), simulated events, events per second, requests per second and the simulated span (and,
for Mooncake, whose decode batches advance many iterations per event, the decode iterations
simulated per second), and
`plot_bench` draws wall time per system against the 20 s target.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from yuebing.core.config import require
from yuebing.sim.runner import load_systems, simulate
from yuebing.sim.system import SYSTEMS, SimConfig
from yuebing.sim.workload import load_requests

TARGET_S = 20.0
"""Issue 2 target: the whole conversation trace on 16 nodes in ≤ 20 s per system."""


def check_bench_args(systems: Sequence[str], repeat: int, limit: int) -> None:
    """`ConfigError` for an empty or unknown system name, ``repeat`` < 1 or ``limit`` < 0."""
    require(bool(systems), "name at least one system to time")
    load_systems()
    for name in systems:
        SYSTEMS.get(name)
    require(repeat >= 1, f"repeat must be >= 1, got {repeat}")
    require(limit >= 0, f"limit must be >= 0 (0 = whole trace), got {limit}")


def run_bench(trace: str | Path, systems: Sequence[str], repeat: int = 1,
              limit: int = 0) -> dict[str, dict[str, float]]:
    """{system: {"wall_s", "events", "events_per_s", "requests", "requests_per_s", ...}}."""
    check_bench_args(systems, repeat, limit)  # bad arguments fail before any work
    t0 = time.perf_counter()
    reqs = load_requests(trace, limit=limit or None)
    load_s = time.perf_counter() - t0
    out: dict[str, dict[str, float]] = {}
    for name in systems:
        best = None
        for _ in range(repeat):
            t1, c1 = time.perf_counter(), time.process_time()
            res = simulate(reqs, SimConfig(system=name, prefill_nodes=8, decode_nodes=8))
            total, cpu = time.perf_counter() - t1, time.process_time() - c1
            if best is None or total < best[0]:
                best = (total, cpu, res)
        assert best is not None
        total, cpu, res = best
        out[name] = {
            "wall_s": round(total, 3), "cpu_s": round(cpu, 3), "loop_s": round(res.wall_s, 3),
            "events": res.events,
            "events_per_s": round(res.events / res.wall_s), "requests": len(reqs),
            "requests_per_s": round(len(reqs) / total), "simulated_s": round(res.sim_end_s, 1),
            "trace_load_s": round(load_s, 3), "meets_target": total <= TARGET_S,
        }
        iterations = res.extra.get("decode_iterations")
        if isinstance(iterations, int):
            out[name]["decode_iterations"] = iterations
            out[name]["iterations_per_s"] = round(iterations / res.wall_s)
    return out


def plot_bench(result: dict[str, dict[str, float]], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(names, [result[n]["wall_s"] for n in names])
    ax.bar([n for n in names], [result[n]["cpu_s"] for n in names], width=0.3,
           color="black", alpha=0.4, label="CPU seconds")
    ax.bar_label(bars, labels=[f"{result[n]['wall_s']:.1f} s\n"
                               f"{result[n]['events_per_s'] / 1e3:.0f}k ev/s" for n in names],
                 fontsize=8)
    ax.axhline(TARGET_S, color="red", ls="--", lw=1, label=f"target {TARGET_S:g} s")
    ax.set_ylabel("wall seconds (one core)")
    ax.set_title("Simulating the conversation trace (12,031 requests, 16 nodes)")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
