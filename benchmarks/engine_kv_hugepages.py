"""Paged decode attention over a KV pool on 4 KiB pages vs transparent huge pages (A/B, one
process): two pools of the same shape, one advised with ``MADV_HUGEPAGE`` before its first touch
(what `KVPool` does), the other not; the native kernel runs over all layers of each in turn
(A, B, A, B, ...) with the same scattered block tables. Prints µs per layer call (medians).

    flock /tmp/yb-bench.lock .venv/bin/python benchmarks/engine_kv_hugepages.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from yuebing.engine import native
from yuebing.engine.runtime import advise_hugepages


def _pool(huge: bool, shape: tuple[int, ...]) -> tuple[torch.Tensor, bool]:
    data = torch.empty(shape, dtype=torch.bfloat16)
    advised = advise_hugepages(data) if huge else False
    data.normal_()
    return data, advised


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--blocks", type=int, default=4096, help="blocks per layer in each pool")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    ns = p.parse_args()
    result = native.load()
    if not result.ok:
        raise SystemExit(f"error: {result.error}")
    torch.set_num_threads(ns.threads)
    kvh, bs, hd, heads = 3, 16, 64, 9  # SmolLM2-135M
    shape = (ns.layers, 2, ns.blocks, kvh, bs, hd)
    pools = {"4k": _pool(False, shape), "huge": _pool(True, shape)}
    per_seq = -(-ns.context // bs)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(ns.blocks, generator=gen)[:ns.batch * per_seq]
    table = table.view(ns.batch, per_seq).to(torch.int32)
    lens = torch.full((ns.batch,), ns.context, dtype=torch.int32)
    q = torch.randn(ns.batch, heads, hd, generator=gen).to(torch.bfloat16)
    times: dict[str, list[float]] = {k: [] for k in pools}
    for _ in range(ns.rounds):
        for name, (data, _) in pools.items():
            t0 = time.perf_counter()
            for layer in range(ns.layers):
                torch.ops.yuebing.paged_decode_attention(q, data[layer, 0], data[layer, 1],
                                                         table, lens, hd**-0.5)
            times[name].append((time.perf_counter() - t0) / ns.layers * 1e6)
    print(f"batch {ns.batch}, context {ns.context}, {ns.layers} layers, {ns.threads} threads; "
          f"huge pages advised: {pools['huge'][1]}")
    for name, ts in times.items():
        print(f"{name:5s} {statistics.median(ts):8.1f} us per layer call (median of {ns.rounds})")


if __name__ == "__main__":
    main()
