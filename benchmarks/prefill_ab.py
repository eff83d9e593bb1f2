"""Whole-engine prefills, paired on the same prompts in one `LLMEngine` (order alternating per
round): this checkout's flash prefill kernel vs a ``--baseline`` build of its source (built as in
`flash_ab.py`), or (``--ab amx``) the projections' AMX routes vs their oneDNN / ``torch.mm``
routes (``--amx all``: every projection, chosen in a scratch directory). Per length: medians of
each side's wall time and of the paired wall and CPU ratios (> 1: current faster).

    mkdir /tmp/b && git archive BASE src/yuebing/engine/csrc | tar -xC /tmp/b --strip-components=4
    .venv/bin/python benchmarks/prefill_ab.py --baseline /tmp/b --lens 512,2048,8000 --rounds 9
    .venv/bin/python benchmarks/prefill_ab.py --ab amx --amx all --lens 512,2048 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from flash_ab import load_baseline  # noqa: E402

from yuebing.core import choices as core_choices  # noqa: E402
from yuebing.engine import engine as engine_module  # noqa: E402
from yuebing.engine import native  # noqa: E402
from yuebing.engine.attention import PrefillSlice  # noqa: E402
from yuebing.engine.config import EngineConfig  # noqa: E402
from yuebing.engine.engine import LLMEngine  # noqa: E402
from yuebing.engine.kernels import KernelOps  # noqa: E402
from yuebing.engine.linear import Linear, amx_key  # noqa: E402
from yuebing.engine.sampling import SamplingParams  # noqa: E402


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def _flash_sides(engine: LLMEngine, baseline_dir: Path, op: str) -> Callable[[str], None]:
    """Swaps the engine's prefill attention between the baseline build's kernel and its own."""
    base_op = getattr(load_baseline(baseline_dir), op)

    def baseline(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sl: PrefillSlice,
                 scale: float) -> torch.Tensor:
        out: torch.Tensor = base_op(q, k_cache, v_cache, sl.block_table, sl.context_len, scale)
        return out

    impls = {"baseline": baseline, "current": engine.model.prefill_impl}

    def use(label: str) -> None:
        engine.model.prefill_impl = impls[label]
    return use


def _amx_sides(engine: LLMEngine) -> Callable[[str], None]:
    """Turns the projections' AMX routes off ("baseline") and back on ("current")."""
    lins = [lin for lay in engine.model.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)]
    rows = [lin.amx_rows for lin in lins]
    if not any(rows):
        raise SystemExit("the engine routes no projection to the AMX linear here "
                         f"(signature: {engine.signature()['matmul']}); try --amx all")

    def use(label: str) -> None:
        for lin, r in zip(lins, rows, strict=True):
            lin.amx_rows = r if label == "current" else ()
    return use


def _every_point(linears: Seq[tuple[Linear, torch.Tensor, bool]], ops: KernelOps,
                 points: Seq[int] = (), rounds: int = 0, seed: int = 0
                 ) -> tuple[dict[str, list[int]], dict[str, float]]:
    """`linear.choose_amx` without timing: every projection at every point (``--amx all``)."""
    return {amx_key(lin, silu): list(points) for lin, _, silu in linears}, {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ab", default="flash", choices=("flash", "amx"),
                   help="flash: the prefill kernel vs --baseline's; amx: AMX routes on vs off")
    p.add_argument("--amx", default="chosen", choices=("chosen", "all"),
                   help="--ab amx: the start-up choice's routes, or every projection")
    p.add_argument("--baseline", help="directory with the baseline's csrc sources (--ab flash)")
    p.add_argument("--lens", default="512,2048", help="prompt lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=9, help="paired prefills per length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--op", default="flash_amx", choices=("flash", "flash_amx"))
    p.add_argument("--out", help="write the JSON report here")
    ns = p.parse_args()
    lens = [int(n) for n in ns.lens.split(",")]
    if ns.rounds < 1 or min(lens) < 1:
        p.error("--rounds and every length must be >= 1")
    if ns.ab == "flash" and not ns.baseline:
        p.error("--ab flash needs --baseline")
    if not (res := native.load()).ok:
        raise SystemExit(res.error)
    if ns.ab == "amx" and ns.amx == "all":
        scratch = tempfile.mkdtemp(prefix="prefill_ab-")
        core_choices.choice_dir = lambda: Path(scratch)
        engine_module.choose_amx = _every_point
    engine = LLMEngine(EngineConfig(
        dtype="bfloat16", threads=ns.threads, kv_cache_bytes=2 << 30, max_num_seqs=8,
        max_batch_tokens=max(lens), max_model_len=max(4096, max(lens) + 1), prefix_caching=False,
        prefill_attention=ns.op))
    use = _flash_sides(engine, Path(ns.baseline), ns.op) if ns.ab == "flash" \
        else _amx_sides(engine)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for rnd in range(ns.rounds + 1):  # round 0 warms up
        for length in lens:
            prompt = [random.Random(rnd * 100_003 + length).randrange(100, 49000)
                      for _ in range(length)]
            for label in (("baseline", "current") if rnd % 2 else ("current", "baseline")):
                use(label)
                t0, c0 = time.perf_counter(), time.process_time()
                engine.generate([prompt], params)
                if rnd:
                    samples.setdefault((length, label), []).append(
                        (time.perf_counter() - t0, time.process_time() - c0))
        print(f"round {rnd}/{ns.rounds} done", file=sys.stderr, flush=True)
    cells: list[dict[str, Any]] = []
    what = ns.op if ns.ab == "flash" else f"AMX routes ({ns.amx}) {engine.amx_routes or 'none'}"
    print(f"{what}, {ns.threads} threads, {ns.rounds} rounds\n| tokens | baseline ms | current ms |"
          " speed-up, paired [quartiles] | CPU speed-up, paired |\n|---|---|---|---|---|")
    for length in lens:
        b, c = samples[(length, "baseline")], samples[(length, "current")]
        wall = sorted(x[0] / y[0] for x, y in zip(b, c, strict=True))
        cpu = sorted(x[1] / y[1] for x, y in zip(b, c, strict=True))
        q1, q3 = _quartiles(wall)
        cell = {"tokens": length, "baseline_ms": statistics.median(x[0] for x in b) * 1e3,
                "current_ms": statistics.median(x[0] for x in c) * 1e3,
                "speedup": statistics.median(wall), "q1": q1, "q3": q3,
                "cpu_speedup": statistics.median(cpu)}
        cells.append(cell)
        print(f"| {length} | {cell['baseline_ms']:.1f} | {cell['current_ms']:.1f} | "
              f"{cell['speedup']:.3f} [{q1:.3f}–{q3:.3f}] | {cell['cpu_speedup']:.3f} |")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps({"ab": ns.ab, "amx": engine.amx_routes,
                                            "op": ns.op, "threads": ns.threads,
                                            "rounds": ns.rounds, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
