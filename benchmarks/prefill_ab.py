"""Whole-engine prefill time: this checkout's native kernels vs a baseline build of their sources,
paired on the same prompts.

Two kernel builds cannot share a process, so one worker process per build stays up (an
`LLMEngine` as `benchmarks/prefill_breakdown.py` builds it, bundled model, bf16, ``--threads``)
and the driver asks them in turn for one prefill (a ``max_tokens=1`` request) of the same random
prompt, order alternating every round, so load from other processes hits both alike. Reported per
length: medians of each side's wall and process CPU time and the median of the paired ratios
(baseline / current; > 1: the current build is faster). ``--baseline`` holds the other csrc:

    mkdir /tmp/b && git archive BASE src/yuebing/engine/csrc | tar -xC /tmp/b --strip-components=4
    .venv/bin/python benchmarks/prefill_ab.py --baseline /tmp/b --lens 512,2048,8192 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _worker(ns: argparse.Namespace) -> None:
    """Serve prefills: read "length seed" lines, answer {"wall": s, "cpu": s} lines."""
    from yuebing.engine import native

    if ns.sources:
        native.source_dir = lambda: Path(ns.sources)
        native.SOURCES = tuple(n for n in native.SOURCES if (Path(ns.sources) / n).exists())
    result = native.load()
    if not result.ok:
        raise SystemExit(result.error)
    from yuebing.engine.config import EngineConfig
    from yuebing.engine.engine import LLMEngine
    from yuebing.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(
        dtype="bfloat16", threads=ns.threads, kv_cache_bytes=2 << 30, max_num_seqs=8,
        max_batch_tokens=ns.max_len, max_model_len=max(4096, ns.max_len + 1), prefix_caching=False,
        prefill_attention=ns.prefill_attention))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([[100] * 64], params)
    print(json.dumps({"prefill_attention": engine.prefill_attention,
                      "matmul_routes": engine.matmul_routes}), flush=True)
    for line in sys.stdin:
        length, seed = (int(v) for v in line.split())
        rng = random.Random(seed)
        prompt = [rng.randrange(100, 49000) for _ in range(length)]
        t0, c0 = time.perf_counter(), time.process_time()
        engine.generate([prompt], params)
        print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}),
              flush=True)


def _start(ns: argparse.Namespace, sources: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--worker", "--threads", str(ns.threads), "--max-len",
           str(max(int(n) for n in ns.lens.split(","))), "--prefill-attention",
           ns.prefill_attention] + (["--sources", sources] if sources else [])
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(proc: subprocess.Popen[str], request: str | None = None) -> dict[str, float | str]:
    assert proc.stdin is not None and proc.stdout is not None
    if request is not None:
        proc.stdin.write(request + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"worker exited ({proc.wait()})")
    out: dict[str, float | str] = json.loads(line)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="directory with the baseline build's csrc sources")
    p.add_argument("--lens", default="512,2048", help="prompt lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=9, help="paired prefills per length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-attention", default="auto",
                   help="EngineConfig.prefill_attention of both workers")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sources", help=argparse.SUPPRESS)
    p.add_argument("--max-len", type=int, default=2048, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        _worker(ns)
        return
    if not ns.baseline or ns.rounds < 1:
        p.error("--baseline DIR is required and --rounds must be >= 1")
    procs = {"baseline": _start(ns, ns.baseline), "current": _start(ns, "")}
    try:
        paths = {k: _ask(v) for k, v in procs.items()}
        print(f"choices: {paths}", file=sys.stderr)
        if paths["baseline"] != paths["current"]:
            print("warning: the builds chose differently; pass --prefill-attention", file=sys.stderr)
        samples: dict[tuple[int, str], list[dict[str, float | str]]] = {}
        for rnd in range(ns.rounds):
            for length in (int(n) for n in ns.lens.split(",")):
                order = ("baseline", "current") if rnd % 2 else ("current", "baseline")
                for label in order:
                    samples.setdefault((length, label), []).append(
                        _ask(procs[label], f"{length} {rnd * 1000 + length}"))
            print(f"round {rnd + 1}/{ns.rounds} done", file=sys.stderr, flush=True)
    finally:
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait()
    cells = []
    print("| tokens | baseline ms | current ms | speed-up, paired [quartiles] | CPU speed-up, paired |"
          "\n|---|---|---|---|---|")
    for length in (int(n) for n in ns.lens.split(",")):
        b, c = samples[(length, "baseline")], samples[(length, "current")]
        wall = sorted(float(x["wall"]) / float(y["wall"]) for x, y in zip(b, c, strict=True))
        cpu = sorted(float(x["cpu"]) / float(y["cpu"]) for x, y in zip(b, c, strict=True))
        q = statistics.quantiles(wall, n=4) if len(wall) > 1 else [wall[0]] * 3
        cell = {"tokens": length, "baseline_ms": statistics.median(float(x["wall"]) for x in b) * 1e3,
                "current_ms": statistics.median(float(x["wall"]) for x in c) * 1e3,
                "speedup": statistics.median(wall), "q1": q[0], "q3": q[2],
                "cpu_speedup": statistics.median(cpu)}
        cells.append(cell)
        print(f"| {length} | {cell['baseline_ms']:.1f} | {cell['current_ms']:.1f} | "
              f"{cell['speedup']:.3f} [{q[0]:.3f}–{q[2]:.3f}] | {cell['cpu_speedup']:.3f} |")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps({"rounds": ns.rounds, "threads": ns.threads,
                                            "paths": paths, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
