"""The four projections' time inside whole prefills, AMX routes on vs off, in one engine: each
projection call timed (gate/up with its SiLU·mul), per call the fastest of the rounds, summed
per projection over the layers; the two sides alternate on the same prompts.

Every projection is put on the AMX linear at every measured row count (chosen in a scratch
choice directory, as ``prefill_ab.py --amx all``); "off" clears the routes. With ``--threads 1``
the timer is the thread's CPU time (robust on a loaded host), else wall time.

    PYTHONPATH=src .venv/bin/python benchmarks/amx_in_engine.py --lens 512,2048 --rounds 10
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prefill_ab import _amx_sides, _every_point  # noqa: E402

from yuebing.core import choices as core_choices  # noqa: E402
from yuebing.engine import engine as engine_module  # noqa: E402
from yuebing.engine import linear  # noqa: E402
from yuebing.engine.config import EngineConfig  # noqa: E402
from yuebing.engine.engine import LLMEngine  # noqa: E402
from yuebing.engine.kernels import KernelOps  # noqa: E402
from yuebing.engine.sampling import SamplingParams  # noqa: E402


def _best_ms(runs: list[dict[str, list[float]]], key: str) -> float:
    """Sum over ``key``'s calls of each call's fastest round, in ms."""
    return sum(min(r[key][j] for r in runs) for j in range(len(runs[0][key]))) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lens", default="512,2048")
    p.add_argument("--rounds", type=int, default=10, help="timed prefills per side and length")
    p.add_argument("--threads", type=int, default=1)
    ns = p.parse_args()
    lens = [int(n) for n in ns.lens.split(",")]
    if ns.rounds < 1 or min(lens) < 1:
        p.error("--rounds and every length must be >= 1")
    scratch = tempfile.mkdtemp(prefix="amx_in_engine-")
    core_choices.choice_dir = lambda: Path(scratch)
    engine_module.choose_amx = _every_point
    engine = LLMEngine(EngineConfig(
        dtype="bfloat16", threads=ns.threads, kv_cache_bytes=2 << 30, max_num_seqs=8,
        max_batch_tokens=max(lens), max_model_len=max(4096, max(lens) + 1), prefix_caching=False))
    use = _amx_sides(engine)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    names = {id(getattr(lay, n)): n for lay in engine.model.layers for n in ("qkv", "o", "down")}
    rec: dict[str, list[float]] = defaultdict(list)
    call, silu_mul = linear.Linear.__call__, linear.Linear.silu_mul

    def timed_call(self: linear.Linear, x: torch.Tensor) -> torch.Tensor:
        t0 = clock()
        out = call(self, x)
        if id(self) in names:
            rec[names[id(self)]].append(clock() - t0)
        return out

    def timed_silu_mul(self: linear.Linear, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        t0 = clock()
        out = silu_mul(self, x, ops)
        rec["gate_up+silu"].append(clock() - t0)
        return out

    linear.Linear.__call__ = timed_call
    linear.Linear.silu_mul = timed_silu_mul
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print(f"{ns.threads} threads, {'thread CPU' if clock is time.thread_time else 'wall'} ms, "
          f"sum over layers of each call's fastest round; ratio = on / off")
    for length in lens:
        runs: dict[str, list[dict[str, list[float]]]] = {"baseline": [], "current": []}
        for rnd in range(ns.rounds + 1):  # round 0 warms up
            prompt = [random.Random(rnd * 100_003 + length).randrange(100, 49000)
                      for _ in range(length)]
            for label in (("baseline", "current") if rnd % 2 else ("current", "baseline")):
                use(label)
                rec.clear()
                engine.generate([prompt], params)
                if rnd:
                    runs[label].append({k: list(v) for k, v in rec.items()})
        off = {k: _best_ms(runs["baseline"], k) for k in runs["baseline"][0]}
        on = {k: _best_ms(runs["current"], k) for k in runs["current"][0]}
        print(f"{length} tokens: " + ", ".join(
            f"{k} {off[k]:.1f} → {on[k]:.1f} ({on[k] / off[k]:.2f})" for k in sorted(off))
              + f"; all {sum(off.values()):.1f} → {sum(on.values()):.1f} "
                f"({sum(on.values()) / sum(off.values()):.2f})", flush=True)


if __name__ == "__main__":
    main()
