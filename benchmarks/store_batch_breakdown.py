#!/usr/bin/env python3
"""Where a same-host batch put's time goes: a client's ``batch_put_from`` of ``--items`` values
of ``--size`` into a node on this host (master and node as child processes, checksums off, the
defaults otherwise), split into the direct copy, each master RPC the client made (by message
type, client side: wire, wake-ups and the master's work) and the rest of the client, medians
over batches; and the master's own work for that batch's `BatchPutCommit` (commit each item,
reserve the next batch's) timed in-process on a `MasterCore`, per batch and per item.

    .venv/bin/python benchmarks/store_batch_breakdown.py --items 16 --size 1MiB --batches 600
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from typing import Any

import numpy as np

from yuebing.core.clock import VirtualClock
from yuebing.core.config import parse_size
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount
from yuebing.store.benchprocs import start_master, start_node
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig, MasterConfig
from yuebing.store.master.core import MasterCore
from yuebing.transfer import TransferConfig, TransferEngine


def live(items: int, size: int, batches: int) -> dict[str, float]:
    """Median µs per batch: wall, the direct copy, each RPC type; and GB/s."""
    mst = start_master()
    node = start_node(mst.info["address"], str(max(1 << 30, 4 * items * size)))
    c: StoreClient | None = None
    took: dict[str, float] = collections.defaultdict(float)
    rows: list[tuple[float, dict[str, float]]] = []
    try:
        engine = TransferEngine(TransferConfig(metadata="p2p"))
        c = StoreClient(ClientConfig(master=mst.info["address"], checksum=False,
                                     keep_freed=1 << 30), engine=engine)
        rng = np.random.default_rng(0)
        values = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(items)]
        call, copy = c.rpc.call, c.direct.copy

        def timed_call(msg: m.Message, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return call(msg, *a, **k)
            finally:
                took[type(msg).__name__] += time.perf_counter() - t

        def timed_copy(reqs: Any, deadline: float) -> Any:
            t = time.perf_counter()
            try:
                return copy(reqs, deadline)
            finally:
                took["direct copy"] += time.perf_counter() - t

        c.rpc.call, c.direct.copy = timed_call, timed_copy
        per_round = max(2, (1 << 30) // (2 * items * size))  # then remove: the node keeps room
        for b in range(batches + 20):
            removed = b % per_round == 0
            if removed:
                c.remove_all(force=True)
            took.clear()
            t = time.perf_counter()
            codes = c.batch_put_from([f"b{b}/{i}" for i in range(items)], values)
            wall = time.perf_counter() - t
            if codes != [0] * items:
                raise SystemExit(f"batch {b} failed: {codes}")
            if b >= 20 and not removed:  # warm, and not the batch after a removal
                rows.append((wall, dict(took)))
    finally:
        if c is not None:
            c.close()
        node.stop()
        mst.stop()
    out = {"wall_us": statistics.median(r[0] for r in rows) * 1e6}
    for k in sorted(set().union(*(r[1] for r in rows))):
        out[f"{k}_us"] = statistics.median(r[1].get(k, 0.0) for r in rows) * 1e6
    out["gbps"] = items * size / (out["wall_us"] / 1e6) / 1e9
    return out


def in_process(items: int, size: int, batches: int) -> dict[str, float]:
    """Median µs of `MasterCore.handle(BatchPutCommit)` with ``reserve_next`` = ``items``."""
    core = MasterCore(MasterConfig(), VirtualClock(100.0))
    node_conn, client_conn = 3, 7
    core.handle(Mount(client="n0", segment="n0/dram", size=64 << 40, node="n0",
                      incarnation="i0"), None, node_conn)
    core.handle(m.ConnName(client="c", conn=1), None, client_conn)

    def shape(b: int) -> list[m.PutItem]:
        return [m.PutItem(key=f"k{b}/{i}", size=size) for i in range(items)]
    got = core.handle(m.BatchPutStart(client="c", items=shape(-1), reserve_next=items),
                      None, client_conn)
    assert isinstance(got, m.BatchPutTargets) and len(got.reservations) == items, got
    core.handle(m.BatchPutEnd(client="c", keys=[it.key for it in shape(-1)]), None, client_conn)
    held = [r.key for r in got.reservations]
    times = []
    for b in range(batches + 20):
        msg = m.BatchPutCommit(client="c", reservations=held, items=shape(b), reserve_next=items)
        t = time.perf_counter()
        r = core.handle(msg, None, client_conn)
        times.append(time.perf_counter() - t)
        assert isinstance(r, m.BatchPutCommitted) and r.codes == [0] * items, r
        held = [x.key for x in r.reservations]
    us = statistics.median(times[20:]) * 1e6
    return {"master_core_us": us, "master_core_per_item_us": us / items}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--size", type=parse_size, default=1 << 20)
    ap.add_argument("--batches", type=int, default=600)
    ns = ap.parse_args()
    if ns.items < 1 or ns.size < 1 or ns.batches < 1:
        ap.error("--items, --size and --batches must be positive")
    out = {**live(ns.items, ns.size, ns.batches), **in_process(ns.items, ns.size, ns.batches)}
    print(json.dumps({k: round(v, 2) for k, v in out.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
