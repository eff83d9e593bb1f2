"""The master core's own cost per request: `MasterCore.handle` on decoded messages, in one
process (no sockets, no other processes), timed in CPU seconds of this process, so a change to
the master is measured without the noise of the wire, the nodes and a busy machine. ``--ab BEFORE_SRC AFTER_SRC`` runs this file under each tree
alternately (order flipped every round) and prints per-op medians and after/before.

    .venv/bin/python benchmarks/store_master_ops.py --n 20000 --json
    .venv/bin/python benchmarks/store_master_ops.py --ab /tmp/old/src src --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(n: int) -> list[dict]:
    from yuebing.core.clock import VirtualClock
    from yuebing.protocol import store as m
    from yuebing.protocol.store_cluster import Mount
    from yuebing.store.config import MasterConfig
    from yuebing.store.master.core import MasterCore

    clock = VirtualClock(100.0)
    core = MasterCore(MasterConfig(high_watermark=1.0), clock)
    for i in range(8):
        core.handle(Mount(client=f"n{i}", segment=f"n{i}/dram", size=1 << 40, node=f"n{i}"))
    rows = []

    def timed(op: str, calls: int, fn) -> None:
        t = time.process_time()  # this process's CPU: other processes' load does not count
        fn()
        rows.append({"op": op, "ops_per_s": round(calls / (time.process_time() - t), 1)})

    keys = [f"k{i:08x}" for i in range(n)]
    item = m.PutItem

    def two_phase() -> None:
        h = core.handle
        for k in keys:
            h(m.PutStart(client="c", item=item(key=k, size=4096)), None, b"c")
            h(m.PutEnd(client="c", key=k), None, b"c")
    timed("put_start+put_end", n, two_phase)

    def one_rpc() -> None:
        h = core.handle
        t = h(m.PutStart(client="r", item=item(key="r-first", size=4096), reserve_next=True))
        resv = t.reservation.key
        for i in range(n):
            r = h(m.PutCommit(client="r", reservation=resv, item=item(key=f"r{i:08x}", size=4096),
                              reserve_next=True), None, b"r")
            resv = r.reservation.key
    timed("put_commit", n, one_rpc)

    def gets() -> None:
        h = core.handle
        for k in keys:
            r = h(m.GetReplicas(key=k), None, None)
            h(m.ReleaseLeases(keys=[k], ids=[r.lease_id]), None, None)
    timed("get_replicas+release", n, gets)
    timed("exists_hit", n, lambda: [core.handle(m.Exists(key=k)) for k in keys])
    timed("exists_miss", n, lambda: [core.handle(m.Exists(key="x" + k)) for k in keys])
    batches = [keys[i:i + 16] for i in range(0, n, 16)]
    timed("batch_exists_16", len(batches), lambda: [core.handle(m.BatchExists(keys=b))
                                                    for b in batches])
    timed("batch_get_16", len(batches), lambda: [core.handle(m.BatchGetReplicas(keys=b))
                                                 for b in batches])
    timed("tick", 20, lambda: [core.tick() for _ in range(20)])
    timed("remove", n, lambda: [core.handle(m.Remove(key=k)) for k in keys])
    return rows


def ab(before: str, after: str, rounds: int, n: int) -> None:
    got: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
            src = before if which == "before" else after
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src), PYTHONHASHSEED="0")
            out = subprocess.run([sys.executable, __file__, "--n", str(n), "--json"], env=env,
                                 check=True, capture_output=True, text=True).stdout
            for row in json.loads(out):
                got.setdefault(row["op"], {}).setdefault(which, []).append(row["ops_per_s"])
    print(f"# {rounds} rounds, n={n}, load {os.getloadavg()}")
    print(f"{'op':24} {'before ops/s':>12} {'after':>10} {'x':>6}  per-round x")
    for op, d in got.items():
        b, a = statistics.median(d["before"]), statistics.median(d["after"])
        per = " ".join(f"{x / y:.2f}" for x, y in zip(d["after"], d["before"], strict=True))
        print(f"{op:24} {b:12.0f} {a:10.0f} {a / b:6.3f}  {per}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="keys per op")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ab", nargs=2, metavar=("BEFORE_SRC", "AFTER_SRC"))
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    if ns.ab:
        ab(*ns.ab, ns.rounds, ns.n)
        return
    rows = measure(ns.n)
    if ns.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['op']:24} {r['ops_per_s']:12.0f}")


if __name__ == "__main__":
    main()
