"""Native paged decode attention on ragged batches: this checkout's kernels vs a baseline build.

One op call (``torch.ops.yuebing.paged_decode_attention``) per measurement, on batches where one
long sequence needs several 512-token partitions next to many short ones (the case where the
work split matters), plus uniform batches as a regression check. Two kernel builds cannot share
a process (both register ``torch.ops.yuebing``), so each round starts one worker process per
build, alternating (A, B, A, B, ...) so load from other processes hits both alike; the report is
the median over rounds of each worker's median call time. ``--baseline`` is a directory holding
the other build's ``csrc`` sources (e.g. a commit's, from ``git show``). Writes JSON, prints a
Markdown table and plots a PNG. Run under the shared bench lock:

    flock /tmp/yb-bench.lock .venv/bin/python benchmarks/decode_partitions.py \\
        --baseline /tmp/base_csrc --out reports/decode_partitions.json \\
        --plot docs/img/decode_partitions.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name: (heads, kv_heads, head_dim, context lengths)
CASES = {
    "smollm2 31x150+1x2048": (9, 3, 64, [150] * 31 + [2048]),
    "llama3-8b 63x100+1x8192": (32, 8, 128, [100] * 63 + [8192]),
    "smollm2 32x150 (1 partition)": (9, 3, 64, [150] * 32),
    "smollm2 8x1024 (2 partitions each)": (9, 3, 64, [1024] * 8),
}
BLOCK = 16


def _worker(ns: argparse.Namespace) -> None:
    """Load the kernels built from ``ns.sources`` and print each case's median µs per call."""
    import torch

    from yuebing.engine import native

    if ns.sources:
        native.source_dir = lambda: Path(ns.sources)  # type: ignore[assignment]
    result = native.load()
    if not result.ok:
        raise SystemExit(result.error)
    torch.set_num_threads(ns.threads)
    gen = torch.Generator().manual_seed(0)
    times = {}
    for name, (heads, kvh, hd, lens) in CASES.items():
        need = [-(-n // BLOCK) for n in lens]
        blocks = sum(need)
        kc = torch.randn(blocks, kvh, BLOCK, hd, generator=gen).bfloat16()
        vc = torch.randn(blocks, kvh, BLOCK, hd, generator=gen).bfloat16()
        perm = torch.randperm(blocks, generator=gen).to(torch.int32)  # scattered blocks
        table = torch.zeros(len(lens), max(need), dtype=torch.int32)
        used = 0
        for i, nb in enumerate(need):
            table[i, :nb] = perm[used:used + nb]
            used += nb
        q = torch.randn(len(lens), heads, hd, generator=gen).bfloat16()
        lens_t = torch.tensor(lens, dtype=torch.int32)
        op = torch.ops.yuebing.paged_decode_attention
        for _ in range(5):
            op(q, kc, vc, table, lens_t, hd**-0.5)
        samples = []
        for _ in range(ns.calls):
            t0 = time.perf_counter()
            op(q, kc, vc, table, lens_t, hd**-0.5)
            samples.append(time.perf_counter() - t0)
        times[name] = statistics.median(samples) * 1e6
    print(json.dumps(times))


def _run_worker(ns: argparse.Namespace, sources: str, cache: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", "--threads", str(ns.threads), "--calls",
           str(ns.calls)] + (["--sources", sources] if sources else [])
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["cases"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for k, label in enumerate(("baseline", "current")):
        ax.bar([i + (k - 0.5) * width for i in range(len(names))],
               [report["cases"][n][label] for n in names], width, label=label)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (median, log scale)")
    ax.set_title(f"paged decode attention, bf16, {report['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", help="directory with the baseline build's csrc sources")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--cache", default="/tmp/yb-decode-partitions",
                   help="XDG_CACHE_HOME of the workers (builds are cached there)")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--plot", help="write a PNG here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sources", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        _worker(ns)
        return
    if not ns.baseline:
        p.error("--baseline DIR is required (the csrc sources to compare against)")
    from rich.progress import track

    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
    for _ in track(range(ns.rounds), description="rounds (A/B)"):
        runs["baseline"].append(_run_worker(ns, ns.baseline, ns.cache + "/baseline"))
        runs["current"].append(_run_worker(ns, "", ns.cache + "/current"))
    report = {"threads": ns.threads, "rounds": ns.rounds, "calls": ns.calls, "cases": {
        name: {label: statistics.median(r[name] for r in runs[label]) for label in runs}
        for name in CASES}}
    print("| case | baseline µs | current µs | speed-up |\n|---|---|---|---|")
    for name, row in report["cases"].items():
        print(f"| {name} | {row['baseline']:.0f} | {row['current']:.0f} | "
              f"{row['baseline'] / row['current']:.2f}x |")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(report, indent=1))
    if ns.plot:
        _plot(report, ns.plot)


if __name__ == "__main__":
    main()
