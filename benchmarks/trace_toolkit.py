"""Benchmark of the trace toolkit on the released conversation trace.

Measures, side by side in one run (best of ``--repeat`` runs each):
- loading: yuebing's typed msgspec loader vs a stdlib ``json.loads`` loader doing the same
  checks (the obvious hand-written baseline);
- ``trace_stats``;
- global-LRU hit rate at five capacities (target: well under 5 s together);
- 16 local caches at one capacity under each routing rule;
- prompt synthesis throughput (tokens/s) for the first 1,000 requests.
Targets from the task: load < 0.5 s, hit rate at a handful of capacities well under 5 s.

    .venv/bin/python benchmarks/trace_toolkit.py [TRACE] [--repeat 5] [--json] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from yuebing.core.errors import TraceFormatError
from yuebing.trace.hitrate import simulate_global, simulate_local
from yuebing.trace.io import load_trace
from yuebing.trace.model import Request, blocks_needed
from yuebing.trace.prompts import PromptSynthesizer
from yuebing.trace.stats import trace_stats

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/conversation_trace.jsonl"
CAPACITIES = [1e6, 3e6, 1.6e7, 6.4e7, math.inf]


def stdlib_load(path: Path) -> list[Request]:
    """Baseline: json.loads per line with the same field checks, by hand."""
    out = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            obj = json.loads(line)
            for name in ("timestamp", "input_length", "output_length"):
                v = obj.get(name)
                if type(v) is not int or v < 0:
                    raise TraceFormatError(str(path), line_no, name, "expected int >= 0")
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or any(type(h) is not int or h < 0 for h in ids):
                raise TraceFormatError(str(path), line_no, "hash_ids", "expected list of ints")
            if len(ids) > blocks_needed(obj["input_length"]):
                raise TraceFormatError(str(path), line_no, "hash_ids", "too many block ids")
            out.append(Request(obj["timestamp"], obj["input_length"], obj["output_length"],
                               tuple(ids)))
    return out


def best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, value = math.inf, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t0)
    return best, value


def run(trace_path: Path, repeat: int) -> dict[str, Any]:
    from rich.progress import Progress

    res: dict[str, Any] = {"trace": str(trace_path)}
    with Progress(transient=True) as bar:
        task = bar.add_task("benchmarking", total=5)
        res["load_msgspec_s"], trace = best_of(lambda: load_trace(trace_path), repeat)
        res["load_stdlib_json_s"], base = best_of(lambda: stdlib_load(trace_path), repeat)
        assert tuple(base) == trace.requests
        res["requests"] = len(trace)
        bar.advance(task)
        res["stats_s"], _ = best_of(lambda: trace_stats(trace), repeat)
        bar.advance(task)
        res["global_5_capacities_s"], rates = best_of(
            lambda: [simulate_global(trace, c).hit_rate for c in CAPACITIES], repeat)
        res["global_hit_rates"] = {("inf" if math.isinf(c) else str(int(c))): r
                                   for c, r in zip(CAPACITIES, rates, strict=True)}
        bar.advance(task)
        for routing in ("round_robin", "random", "cache_aware"):
            res[f"local16_{routing}_s"], _ = best_of(
                lambda routing=routing: simulate_local(trace, 1.6e7, 16, routing), repeat)
        bar.advance(task)
        ps, head = PromptSynthesizer(), trace.requests[:1000]
        secs, n = best_of(lambda: sum(len(ps.tokens(r, i)) for i, r in enumerate(head)), repeat)
        res["prompt_tokens_per_s"] = n / secs
        bar.advance(task)
    return res


def plot(res: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["load_msgspec_s", "load_stdlib_json_s", "stats_s", "global_5_capacities_s",
            "local16_round_robin_s", "local16_random_s", "local16_cache_aware_s"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.barh(keys, [res[k] for k in keys], color="tab:blue")
    for target, label in ((0.5, "load target 0.5 s"), (5.0, "hit-rate target 5 s")):
        ax.axvline(target, linestyle="--", color="tab:red", linewidth=1)
        ax.text(target, len(keys) - 0.5, label, fontsize=7, color="tab:red", ha="right")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (best of runs, log scale)")
    ax.set_title(f"trace toolkit on {res['requests']:,} requests")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of the timings")
    ns = ap.parse_args()
    res = run(ns.trace, ns.repeat)
    if ns.plot:
        plot(res, ns.plot)
    if ns.json:
        print(json.dumps(res, indent=1))
        return
    for k, v in res.items():
        print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
