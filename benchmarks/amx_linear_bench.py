"""The native AMX linear vs oneDNN's packed bf16 linear per projection shape and row count, in one
process: interleaved rounds, medians of paired ratios, GFLOP/s of each side's fastest round
against the tiles' peak (``threads × GHz × 1024``). Shapes default to SmolLM2-135M's projections;
``gate_up+silu`` puts oneDNN's gate/up plus ``silu_and_mul`` against the AMX kernel's fused store.
A sample runs ``--weights`` weights in turn, as a forward pass does. ``--threads 1 --clock cpu``
times the thread's CPU time, which other processes' load barely moves.

    .venv/bin/python benchmarks/amx_linear_bench.py --rows 256,512,1024,2048 --rounds 15
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from yuebing.engine import amx_linear, native
from yuebing.engine.choices import paired_ratios

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "gate_up+silu": (3072, 576)}


def _ghz() -> float:
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(ln.split(":")[1]) for ln in f if ln.startswith("cpu MHz")]
        return max(mhz) / 1000 if mhz else 2.0
    except OSError:
        return 2.0


def _cases(name: str, n: int, k: int, count: int, gen: torch.Generator
           ) -> tuple[Callable[[torch.Tensor], None], Callable[[torch.Tensor], None]]:
    ws = [(torch.randn(n, k, generator=gen) * k**-0.5).bfloat16() for _ in range(count)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
    silu = name.endswith("+silu")
    amx = [amx_linear.pack_silu_pairs(w) if silu else amx_linear.pack(w) for w in ws]

    def run_onednn(x: torch.Tensor) -> None:
        for p in onednn:
            y = torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            if silu:
                torch.ops.yuebing.silu_and_mul(y)

    def run_amx(x: torch.Tensor) -> None:
        for p in amx:
            amx_linear.linear(x, p, None, amx_linear.SILU_MUL if silu else amx_linear.NONE)

    return run_onednn, run_amx


def _samples(fns: dict[str, Callable[[], None]], rounds: int,
             clock: Callable[[], float]) -> dict[str, list[float]]:
    """Seconds of each candidate per round by ``clock``, order alternating (one warm-up each)."""
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in list(fns) if r % 2 == 0 else reversed(list(fns)):
            t0 = clock()
            fns[name]()
            out[name].append(clock() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="256,512,1024,2048")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--weights", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ghz", type=float, default=0.0)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the calling thread's CPU time (needs --threads 1)")
    p.add_argument("--out", help="write the JSON report here")
    ns = p.parse_args()
    if ns.clock == "cpu" and ns.threads != 1:
        p.error("--clock cpu times the calling thread: use --threads 1")
    clock = time.thread_time if ns.clock == "cpu" else time.perf_counter
    if not (res := native.load()).ok:
        raise SystemExit(res.error)
    if not amx_linear.available():
        raise SystemExit("no AMX-BF16 tiles here (or the kernels were built without them)")
    torch.set_num_threads(ns.threads)
    peak = ns.threads * (ns.ghz or _ghz()) * 1024
    gen = torch.Generator().manual_seed(0)
    report = []
    print(f"peak {peak:.0f} GFLOP/s ({ns.threads} threads, {ns.clock} clock); GFLOP/s of the fastest round; "
          "ratio: AMX time / oneDNN time, median of paired rounds (< 1: AMX faster)")
    with torch.inference_mode():
        for name in ns.shapes.split(","):
            n, k = SHAPES[name]
            run_onednn, run_amx = _cases(name, n, k, ns.weights, gen)
            for m in map(int, ns.rows.split(",")):
                x = torch.randn(m, k, generator=gen).bfloat16()
                samples = _samples({"onednn": functools.partial(run_onednn, x),
                                    "amx": functools.partial(run_amx, x)}, ns.rounds, clock)
                ratios = paired_ratios(samples, "amx", "onednn")
                flop = 2.0 * m * n * k * ns.weights
                row = {"shape": name, "out": n, "in": k, "rows": m,
                       "ratio": statistics.median(ratios), "ratio_q1": ratios[len(ratios) // 4],
                       "ratio_q3": ratios[3 * len(ratios) // 4],
                       **{f"{side}_gflops": flop / min(v) / 1e9 for side, v in samples.items()},
                       **{f"{side}_ms_median": statistics.median(v) * 1e3 / ns.weights
                          for side, v in samples.items()}}
                report.append(row)
                print(f"{name:13s} {m:5d} rows  onednn {row['onednn_gflops']:6.0f}  amx "
                      f"{row['amx_gflops']:6.0f} GFLOP/s ({row['amx_gflops'] / peak:4.0%} of "
                      f"peak)  ratio {row['ratio']:.2f} [{row['ratio_q1']:.2f}, "
                      f"{row['ratio_q3']:.2f}]", flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"peak_gflops": peak, "threads": ns.threads, "clock": ns.clock, "rounds": ns.rounds,
                       "weights": ns.weights, "results": report}, f, indent=1)


if __name__ == "__main__":
    main()
