"""Decode at batch 1 against the machine's memory-bandwidth floor (issue 25's engine target).

A batch-1 decode step reads every matmul weight once (and a little KV), so it cannot beat
weight bytes ÷ read bandwidth. This script measures, on the machine it runs on and with the
engine's own threads: the read bandwidth (median of summing a 1 GiB buffer, far larger than
the caches), the weight bytes the step reads (every linear layer and the LM head as the engine
holds them), and the engine's batch-1 decode step (median of 32 steps at a 128-token context).
``--compare`` also times the op-by-op step, interleaved with the fused one (wall and process CPU time; see
`yuebing.engine.fused_decode`).

    .venv/bin/python benchmarks/decode_floor.py [--threads 2] [--compare] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.profile import Timing, _Tokens, median_timing, time_decode
from yuebing.engine.runtime import machine


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second of summing a buffer much larger than the caches (``threads`` threads)."""
    torch.set_num_threads(threads)
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.nbytes / statistics.median(times)


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of the weights a decode step reads: each layer's q/k/v/o and gate/up/down
    projections and the LM head, in the engine's dtype (the token embedding's one row per
    token is negligible)."""
    c = engine.model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    return params * engine.dtype.itemsize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare", action="store_true",
                    help="also time the op-by-op step (fused decode off), interleaved")
    ns = ap.parse_args()
    engine = LLMEngine(EngineConfig(threads=ns.threads))
    engine.warmup()
    tokens = _Tokens(engine.model_config.vocab_size)
    fused = engine.model.fused
    paths = {"chosen": fused, **({"op_by_op": None} if ns.compare and fused else {})}
    samples: dict[str, list[Timing]] = {name: [] for name in paths}
    for _ in range(3):
        for name, path in paths.items():
            engine.model.fused = path
            samples[name].append(time_decode(engine, 1, 128, tokens, steps=32))
    engine.model.fused = fused
    medians = {name: median_timing(ts) for name, ts in samples.items()}
    step_s = medians["chosen"].wall
    nbytes = weight_bytes(engine)
    bw = read_bandwidth(ns.threads)
    floor_s = nbytes / bw
    out = {"machine": machine(), "threads": ns.threads, "dtype": str(engine.dtype),
           "weight_bytes": nbytes, "read_GBps": bw / 1e9, "floor_ms": 1e3 * floor_s,
           "decode_fused": engine.decode_fused,
           "decode_b1_ms": 1e3 * step_s, "share_of_floor": floor_s / step_s,
           **{f"{name}_ms": {"wall": 1e3 * t.wall, "cpu": 1e3 * t.cpu}
              for name, t in medians.items()}}
    if ns.json:
        print(json.dumps(out))
    else:
        print(f"{out['machine']}, {ns.threads} threads, {out['dtype']}: weights "
              f"{nbytes / 1e6:.0f} MB, read {bw / 1e9:.1f} GB/s -> floor "
              f"{out['floor_ms']:.1f} ms; decode b=1 {out['decode_b1_ms']:.1f} ms = "
              f"{out['share_of_floor']:.2f} of the floor (fused decode {engine.decode_fused})")
        for name, t in medians.items():
            print(f"  {name}: wall {1e3 * t.wall:.1f} ms, process CPU {1e3 * t.cpu:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
