#!/usr/bin/env python3
"""Store latency A/B: the client-side latency knobs on and off, interleaved in one process.

One master + one node (child processes, loopback) and one TCP-only client (``remote_tcp`` of
``yuebing bench store``). Per operation the variants (`VARIANTS`) take turns in chunks of
``--chunk`` s, ``--rounds`` times, so load drifts hit them alike: median µs per call, and with
two ``--variants`` the median (range) of each round's ratio, second / first. The master's
``--spin-us`` is a process flag: one run per value (``--master-spin``); ``--load N`` adds N
busy loops. Commit on landing A/B (docs/benchmarks.md):

    .venv/bin/python benchmarks/store_latency_ab.py --master-spin -1 --variants inline+spin,no-landing \
        --ops put_1m,put_from_1m,put_from_4m --rounds 15
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

VARIANTS = {"plain": (0, 0, 0, True), "inline": (4 << 20, 0, 0, True),
            "inline+spin": (4 << 20, 50, 100, True), "no-landing": (4 << 20, 50, 100, False)}
"""name → (inline_bytes, transfer spin µs, client RPC spin µs, commit on landing): ``plain``
transfers through the lane threads, no spinning; ``inline`` transfers of <= 4 MiB per peer in
the calling thread (`TransferConfig.inline_bytes`); ``inline+spin`` also polls for answers
before sleeping (the defaults); ``no-landing`` the defaults but a put into a reservation commits
with an RPC after its write (`ClientConfig.commit_on_landing`, docs/store.md)."""
OPS = ("exists", "put_4k", "get_4k", "put_1m", "put_from_1m", "get_1m", "put_from_4m", "get_4m")


class Rig:
    """Master + node children and one TCP-only client with switchable knobs."""

    def __init__(self, master_spin: int) -> None:
        from yuebing.store.benchprocs import start_master, start_node
        from yuebing.store.client.client import StoreClient
        from yuebing.store.config import ClientConfig
        from yuebing.transfer import TransferConfig, TransferEngine

        self.mst = start_master("--spin-us", str(master_spin))
        self.node = start_node(self.mst.info["address"], "2GiB")
        self.eng = TransferEngine(TransferConfig(metadata="p2p", transports=("tcp",)))
        self.c = StoreClient(ClientConfig(master=self.mst.info["address"], checksum=False),
                             engine=self.eng)
        self.src = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
        self.vals = {n: self.src[:n].tobytes() for n in (4096, 1 << 20, 4 << 20)}
        self.i = 0

    def seed(self) -> None:
        """Keys the get operations read (written again after each round's removals)."""
        c = self.c
        c.remove_all(force=True)
        for i in range(200):
            c.put(f"k4/{i}", self.vals[4096])
        for i in range(20):
            c.put(f"k1m/{i}", self.vals[1 << 20])
            c.put(f"k4m/{i}", self.vals[4 << 20])

    def set_variant(self, name: str) -> None:
        inline, tspin, cspin, landing = VARIANTS[name]
        self.c.cfg = dataclasses.replace(self.c.cfg, commit_on_landing=landing)
        object.__setattr__(self.eng.config, "inline_bytes", inline)  # frozen: scratch switch
        object.__setattr__(self.eng.config, "spin_us", tspin)
        pool = self.eng._peers.pool
        for ep in list(pool._values.values()):
            conn = getattr(ep, "_inline", None)
            if conn is not None:
                conn.spin_s = tspin * 1e-6
        self.c.rpc.spin_s = cspin * 1e-6
        if self.c.rpc.sock is not None:
            self.c.rpc.sock.spin_s = cspin * 1e-6

    def op(self, name: str) -> Callable[[], Any]:
        c, v, src = self.c, self.vals, self.src

        def call() -> Any:
            self.i += 1
            i = self.i
            if name == "exists":
                return c.exists(f"k4/{i % 200}")
            if name == "put_4k":
                return c.put(f"p4/{i}", v[4096])
            if name == "get_4k":
                return c.get(f"k4/{i % 200}")
            if name == "put_1m":
                return c.put(f"p1m/{i}", v[1 << 20])
            if name == "put_from_1m":
                j = i % 64
                return c.put_from(f"pf1m/{i}", src[j << 20:(j + 1) << 20])
            if name == "get_1m":
                return c.get(f"k1m/{i % 20}")
            if name == "put_from_4m":
                j = i % 16
                return c.put_from(f"pf4m/{i}", src[j << 22:(j + 1) << 22])
            return c.get(f"k4m/{i % 20}")
        return call

    def close(self) -> None:
        self.c.close()
        self.node.stop()
        self.mst.stop()


def measure(rig: Rig, ops: list[str], variants: list[str], rounds: int, chunk: float,
            progress: Any) -> dict:
    res: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        rig.seed()
        for op in ops:
            fn = rig.op(op)
            for v in variants if r % 2 == 0 else variants[::-1]:
                rig.set_variant(v)
                fn()
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < chunk:
                    fn()
                    n += 1
                res.setdefault((op, v), []).append((time.perf_counter() - t0) / n * 1e6)
                if op.startswith("put"):  # keep the 2 GiB segment clear of eviction
                    for p in ("p4/", "p1m/", "pf1m/", "pf4m/"):
                        rig.c.remove_prefix(p, force=True)
            progress()
    out: dict = {op: {v: round(statistics.median(res[(op, v)]), 1) for v in variants}
                 for op in ops}
    if len(variants) == 2:  # each round's second / first variant µs: how much faster the first
        a, b = variants
        for op in ops:
            rs = sorted(y / x for x, y in zip(res[(op, a)], res[(op, b)], strict=True))
            out[op]["x"] = round(statistics.median(rs), 3)
            out[op]["x_range"] = [round(rs[0], 3), round(rs[-1], 3)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--master-spin", type=int, default=500, help="the master's --spin-us")
    ap.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"subset of {','.join(VARIANTS)} (taking turns, order swapped per round)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=float, default=0.25, help="seconds per variant and turn")
    ap.add_argument("--load", type=int, default=0, help="busy-loop processes to add")
    ap.add_argument("--json", default="", help="also write the medians here")
    ns = ap.parse_args()
    ops = [o for o in ns.ops.split(",") if o]
    variants = [v for v in ns.variants.split(",") if v]
    bad = [o for o in ops if o not in OPS] + [v for v in variants if v not in VARIANTS]
    if bad or ns.rounds < 1 or ns.chunk <= 0 or ns.load < 0:
        raise SystemExit(f"bad --ops {bad} / --rounds / --chunk / --load")
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(ns.load)]
    rig = None
    try:
        rig = Rig(ns.master_spin)
        with Progress(console=Console(stderr=True), transient=True) as prog:
            task = prog.add_task("store latency A/B", total=ns.rounds * len(ops))
            out = measure(rig, ops, variants, ns.rounds, ns.chunk, lambda: prog.advance(task))
    finally:
        if rig is not None:
            rig.close()
        for p in busy:
            p.kill()
            p.wait()
    t = Table(title=f"µs per call, median of {ns.rounds} chunks (master --spin-us "
                    f"{ns.master_spin}, {ns.load} busy loops)")
    t.add_column("op")
    for v in variants:
        t.add_column(v, justify="right")
    paired = len(variants) == 2
    if paired:
        t.add_column(f"{variants[1]} / {variants[0]} per round", justify="right")
    for op, row in out.items():
        cells = [f"{row[v]:.1f}" for v in variants]
        if paired:
            cells.append(f"{row['x']:.3f} ({row['x_range'][0]:.2f}–{row['x_range'][1]:.2f})")
        t.add_row(op, *cells)
    Console().print(t)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"master_spin_us": ns.master_spin, "load": ns.load, "us_per_call": out}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
