#!/usr/bin/env python3
"""Same-host single reads A/B: the client's read small-copy limit (`streamcopy.small_copy`:
up to it a get copies out of the node's segment by memcpy, above it by streaming stores) as
this machine measured it, against streaming everything above 64 KiB and memcpy everything, in
turns of ``--calls`` gets per variant, ``--rounds`` times, in one process (load drifts hit all
alike). Prints per size and variant the median µs of a whole `get_into` and of its copy alone.

    .venv/bin/python benchmarks/store_read_copy_ab.py --sizes 256KiB,1MiB,2MiB,3MiB --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from yuebing.core.config import parse_size
from yuebing.store.benchprocs import start_master, start_node
from yuebing.store.client import direct
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig
from yuebing.transfer import streamcopy


def main() -> None:
    ap = argparse.ArgumentParser(description="same-host gets at this machine's read small-copy "
                                 "limit vs streaming vs memcpy, in turns")
    ap.add_argument("--sizes", default="256KiB,1MiB,2MiB,3MiB",
                    help="value sizes (single reads of 4 MiB and more are split over threads)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--keys", type=int, default=256, help="values per size (cycled: cold reads)")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if not streamcopy.streaming():
        raise SystemExit("store_read_copy_ab: no streaming stores here: every copy is memcpy")
    write, measured = streamcopy.small_copy(), streamcopy.small_copy(read=True)
    variants = {f"measured ({measured >> 10} KiB)": measured,
                "streaming (64 KiB)": streamcopy.SMALL_CANDIDATES[0], "memcpy": 1 << 40}
    took: list[float] = []
    plain = direct._copy

    def timed(*a: Any, **k: Any) -> int:
        t0 = time.perf_counter()
        n = plain(*a, **k)
        took.append(time.perf_counter() - t0)
        return n

    table = Table("size", *[f"{v}: get_into / copy µs" for v in variants],
                  title=f"same-host get_into, medians of {args.rounds} rounds × {args.calls}")
    direct._copy = timed
    mst = start_master()
    node = start_node(mst.info["address"], str(max(64 << 20, max(sizes) * args.keys * 2)))
    c: StoreClient | None = None
    try:
        c = StoreClient(ClientConfig(master=mst.info["address"], checksum=False))
        for size in sizes:
            src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
            dst = np.ones(size, np.uint8)
            for i in range(args.keys):
                c.put_from(f"{size}/{i}", src)
            res: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in variants}
            names = list(variants)
            for r in range(args.rounds):
                for v in names if r % 2 == 0 else names[::-1]:
                    streamcopy._small = (write, variants[v])
                    for i in range(args.calls):
                        took.clear()
                        t0 = time.perf_counter()
                        c.get_into(f"{size}/{i % args.keys}", dst)
                        res[v][0].append(time.perf_counter() - t0)
                        res[v][1].append(sum(took))
                    assert (dst == src).all()
            table.add_row(f"{size >> 10} KiB", *[
                f"{statistics.median(a) * 1e6:.1f} / {statistics.median(b) * 1e6:.1f}"
                for a, b in res.values()])
            c.remove_all(force=True)
    finally:
        if c is not None:
            c.close()
        streamcopy._small = (write, measured)
        direct._copy = plain
        node.stop()
        mst.stop()
    Console().print(table)


if __name__ == "__main__":
    main()
