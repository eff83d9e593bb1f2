"""Decode step time against context length: this checkout's kernels vs a baseline build.

The 1P1D head to head's TBT misses are decode steps of 2–4 sequences holding 1–4k tokens each
(docs/engine.md, "Decode steps at long context"). This times whole engine decode steps (the
bundled model, bf16, the fused decode forced to ``--fused-decode`` rows as ``yuebing serve``
chooses it here) at each ``--contexts`` tokens per sequence and batch 4, 3, 2, 1 (one prefill
per context, then a request aborted per batch size). Two kernel builds cannot share a process,
so each round starts one worker per build and thread count, alternating (A, B, A, B, ...) so
load from other processes hits both alike; the report is the median over rounds of each
worker's median step. ``--baseline`` is a directory holding the other build's ``csrc`` sources:

    mkdir /tmp/b && git archive BASE src/yuebing/engine/csrc | tar -xC /tmp/b --strip-components=4
    .venv/bin/python benchmarks/decode_context.py --baseline /tmp/b --threads 1,2
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


def _worker(ns: argparse.Namespace) -> None:
    """Load the kernels built from ``ns.sources``; print {context: {batch: [median step ms,
    median process CPU ms]}} (CPU time: the work, less sensitive to other processes)."""
    import torch

    from yuebing.engine import native

    if ns.sources:
        native.source_dir = lambda: Path(ns.sources)  # type: ignore[assignment]
        # an older build may lack a header this checkout added
        native.SOURCES = tuple(n for n in native.SOURCES if (Path(ns.sources) / n).exists())
    result = native.load()
    if not result.ok:
        raise SystemExit(result.error)
    from yuebing.engine.config import EngineConfig
    from yuebing.engine.engine import LLMEngine
    from yuebing.engine.profile import _Tokens, start_decoding

    contexts = [int(c) for c in ns.contexts.split(",")]
    engine = LLMEngine(EngineConfig(threads=ns.threads, dtype="bfloat16",
                                    fused_decode=ns.fused_decode, prefix_caching=False))
    engine.warmup()
    torch.set_num_threads(ns.threads)
    tokens = _Tokens(engine.model_config.vocab_size)
    out: dict[int, dict[int, list[float]]] = {}
    for ctx in contexts:
        rids = start_decoding(engine, 4, ctx, ns.steps * 8 + 8, tokens)
        out[ctx] = {}
        for batch in (4, 3, 2, 1):
            wall, cpu = [], []
            for _ in range(ns.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                engine.step()
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            out[ctx][batch] = [statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3]
            engine.abort(rids.pop())
        for r in rids:
            engine.abort(r)
    print(json.dumps(out))


def _run_worker(ns: argparse.Namespace, threads: int, sources: str,
                cache: str) -> dict[str, dict[str, list[float]]]:
    cmd = [sys.executable, __file__, "--worker", "--threads", str(threads), "--contexts",
           ns.contexts, "--steps", str(ns.steps), "--fused-decode", str(ns.fused_decode)] + \
        (["--sources", sources] if sources else [])
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", help="directory with the baseline build's csrc sources")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    p.add_argument("--contexts", default="256,1024,2048,3072",
                   help="tokens per sequence, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per point")
    p.add_argument("--fused-decode", type=int, default=4,
                   help="EngineConfig.fused_decode of both builds (0 = op by op)")
    p.add_argument("--cache", default="/tmp/yb-decode-context",
                   help="XDG_CACHE_HOME prefix of the workers (builds are cached there)")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sources", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        ns.threads = int(ns.threads)
        _worker(ns)
        return
    if not ns.baseline:
        p.error("--baseline DIR is required (the csrc sources to compare against)")
    threads = [int(t) for t in ns.threads.split(",")]
    runs: dict[tuple[int, str], list[dict[str, dict[str, list[float]]]]] = {}
    for rnd in range(ns.rounds):
        for t in threads:
            for label, src in (("baseline", ns.baseline), ("current", "")):
                runs.setdefault((t, label), []).append(
                    _run_worker(ns, t, src, f"{ns.cache}/{label}"))
        print(f"round {rnd + 1}/{ns.rounds} done", file=sys.stderr, flush=True)
    report: dict[str, object] = {"rounds": ns.rounds, "steps": ns.steps,
                                 "fused_decode": ns.fused_decode, "cells": []}
    print("| threads | context/seq | batch | baseline ms | current ms | speed-up | "
          "CPU ms baseline / current | CPU ratio |\n|---|---|---|---|---|---|---|---|")
    cells: list[dict[str, float]] = []
    for t in threads:
        for ctx in ns.contexts.split(","):
            for b in ("1", "2", "3", "4"):
                base, cur = (statistics.median(r[ctx][b][0] for r in runs[(t, label)])
                             for label in ("baseline", "current"))
                bcpu, ccpu = (statistics.median(r[ctx][b][1] for r in runs[(t, label)])
                              for label in ("baseline", "current"))
                cells.append({"threads": t, "context": int(ctx), "batch": int(b),
                              "baseline_ms": base, "current_ms": cur,
                              "baseline_cpu_ms": bcpu, "current_cpu_ms": ccpu})
                print(f"| {t} | {ctx} | {b} | {base:.1f} | {cur:.1f} | {base / cur:.2f}x | "
                      f"{bcpu:.1f} / {ccpu:.1f} | {bcpu / ccpu:.2f}x |")
    report["cells"] = cells
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
