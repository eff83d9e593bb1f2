"""Where one prefill's time goes: every op of `LlamaModel.forward` timed, through the engine's
defaults (an `LLMEngine` as `benchmarks/peers/run_ours.py` builds it).

Wraps the projections (`Linear.__call__`, named qkv / o / gate_up / down / lm_head), the small ops
of ``model.ops``, the attention and the fused LM head with wall-clock timers, runs ``--repeats``
fresh L-token prompts (``max_tokens=1``; ``--cached N``: each after the same cached N-token
prefix) and reports, per op, the sum over its calls of each call's minimum over the repeats
(robust to a busy machine), the rest of the forward pass (embedding, Python glue) and of the
step. Writes a table, optionally JSON.

    PYTHONPATH=src .venv/bin/python benchmarks/prefill_breakdown.py --lens 512,2048 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from yuebing.engine import linear
from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams

Record = dict[str, list[float]]


def instrument(engine: LLMEngine, rec: Record) -> None:
    """Time every op the forward pass calls into ``rec`` (op name → one duration per call)."""
    model = engine.model

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            rec[key].append(time.perf_counter() - t0)
            return out
        return run

    names = {id(getattr(lay, n)): n for lay in model.layers for n in ("qkv", "o", "gate_up", "down")}
    names[id(model.lm_head)] = "lm_head"
    call = linear.Linear.__call__
    linear.Linear.__call__ = lambda self, x: timed(names.get(id(self), "linear"), call)(self, x)  # type: ignore[method-assign]
    for op in ("rms_norm", "add_rms_norm", "rope_write_kv", "silu_mul"):
        setattr(model.ops, op, timed(op, getattr(model.ops, op)))
    model._attention = timed("attention", model._attention)  # type: ignore[method-assign]
    if model.fused is not None:
        model.fused.logits = timed("lm_head(fused)", model.fused.logits)  # type: ignore[method-assign]
    model.forward = timed("forward", model.forward)  # type: ignore[method-assign]


def breakdown(engine: LLMEngine, rec: Record, length: int, repeats: int,
              rng: random.Random, cached: int = 0) -> dict[str, Any]:
    """One length's parts (``rec``: the instrumented engine's record); ``cached``: every
    prompt starts with the same ``cached`` tokens, prefilled once before (a prefix hit)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix = [rng.randrange(100, 49000) for _ in range(cached)]
    if prefix:
        engine.generate([prefix + [7]], params)
    runs: list[Record] = []
    for i in range(repeats + 2):  # two warm-ups
        rec.clear()
        t0 = time.perf_counter()
        engine.generate([prefix + [rng.randrange(100, 49000) for _ in range(length)]], params)
        rec["step"].append(time.perf_counter() - t0)
        if i >= 2:
            runs.append({k: list(v) for k, v in rec.items()})
    ops = {k: sum(min(r[k][j] for r in runs) for j in range(len(runs[0][k])))
           for k in runs[0] if k not in ("step", "forward")}
    glue = min(r["forward"][0] - sum(sum(v) for k, v in r.items() if k not in ("step", "forward"))
               for r in runs)
    outside = min(r["step"][0] - r["forward"][0] for r in runs)
    return {"tokens": length, "ops_s": ops, "forward_glue_s": glue, "outside_forward_s": outside,
            "step_min_s": min(r["step"][0] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=15, help="timed prompts per length (>= 1)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="the engine's dtype (auto: bf16 where the CPU has bf16 instructions)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cached", type=int, default=0,
                    help="a prefix of this many tokens, the same for every prompt and cached "
                         "(prefix caching on): the lengths are the new tokens after it")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    lens = [int(v) for v in a.lens.split(",")]
    if a.repeats < 1 or a.threads < 1 or min(lens) < 1 or a.cached < 0:
        ap.error("--repeats, --threads and every length must be >= 1, --cached >= 0")
    longest = a.cached + max(lens)
    engine = LLMEngine(EngineConfig(
        model=a.model, dtype=a.dtype, threads=a.threads, kv_cache_bytes=2 << 30,
        max_num_seqs=8, max_batch_tokens=max(lens), max_model_len=max(4096, longest + 1),
        prefix_caching=a.cached > 0))
    print(f"{engine.dtype}, prefill attention {engine.prefill_attention}, kernels {engine.kernels.name}, "
          f"threads {torch.get_num_threads()}, fused decode {engine.decode_fused}")
    rec: Record = defaultdict(list)
    instrument(engine, rec)
    results = []
    for length in lens:
        r = breakdown(engine, rec, length, a.repeats, random.Random(length), a.cached)
        results.append(r)
        parts = {**r["ops_s"], "forward glue": r["forward_glue_s"],
                 "outside forward": r["outside_forward_s"]}
        total = sum(parts.values())
        print(f"\n{length} tokens after {a.cached} cached: sum of parts {total * 1e3:.1f} ms, "
              f"fastest step {r['step_min_s'] * 1e3:.1f} ms")
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {k:16s} {v * 1e3:8.2f} ms  {100 * v / total:5.1f} %")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
