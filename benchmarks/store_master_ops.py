"""The master core's own cost per request: `MasterCore.handle` on decoded messages, in one
process (no sockets, no other processes), timed in CPU seconds of this process, so a change to
the master is measured without the noise of the wire, the nodes and a busy machine. ``--service``
times whole requests instead: encoded frames through `MasterService` (decode, dispatch, reply
encoding, the flush after each) with the replies kept, not sent. ``--ab BEFORE_SRC AFTER_SRC``
runs this file under each tree alternately (order flipped every round) and prints per-op
medians and after/before.

    .venv/bin/python benchmarks/store_master_ops.py --n 20000 --json
    .venv/bin/python benchmarks/store_master_ops.py --ab /tmp/old/src src --rounds 5 [--service]
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


CHUNK = 250
"""Requests per timed chunk of `measure_service`."""


def measure_service(n: int) -> list[dict]:
    """Requests through `MasterService` (frame in, reply out, flush), one DRAM segment of
    1 TiB, no standbys: what the master spends per request between its socket calls."""
    from yuebing.protocol import decode, encode
    from yuebing.protocol import store as m
    from yuebing.protocol.store_cluster import Mount
    from yuebing.store.config import MasterConfig
    from yuebing.store.master.service import MasterService

    svc = MasterService(MasterConfig(rpc_address="tcp://127.0.0.1:0", high_watermark=1.0))
    svc._roles()  # the leader (no etcd)
    replies: list[bytes] = []
    svc.server.send = lambda cid, rid, payload: replies.append(payload)  # type: ignore[method-assign]
    on_frame, flush = svc._on_frame, svc._flush

    def call(msg: object) -> object:
        on_frame(1, 1, encode(msg))
        flush()
        return decode(replies.pop())

    call(Mount(client="n0", segment="n0/dram", size=1 << 40, node="n0"))
    rows = []

    def timed(op: str, frames: list[bytes]) -> None:
        """The least CPU time per request over chunks of `CHUNK` (a busy machine's other load
        only ever adds to it)."""
        best = float("inf")
        for c in range(0, len(frames), CHUNK):
            t = time.thread_time()
            for f in frames[c:c + CHUNK]:
                on_frame(1, 1, f)
                flush()
            best = min(best, (time.thread_time() - t) / len(frames[c:c + CHUNK]))
            replies.clear()
        rows.append({"op": op, "ops_per_s": round(1 / best, 1)})

    size, val = 1 << 20, b"v" * 4096
    resv = call(m.PutStart(client="r", item=m.PutItem(key="first", size=size),
                           reserve_next=True)).reservation.key  # type: ignore[attr-defined]
    best = float("inf")  # each commit names the reservation the previous one handed out
    for c in range(0, n, CHUNK):
        t = time.thread_time()
        for i in range(c, min(n, c + CHUNK)):
            resv = call(m.PutCommit(client="r", reservation=resv, item=m.PutItem(
                key=f"c{i:08x}", size=size), reserve_next=True)).reservation.key  # type: ignore[attr-defined]
        best = min(best, (time.thread_time() - t) / (min(n, c + CHUNK) - c))
    rows.append({"op": "put_commit_1MiB", "ops_per_s": round(1 / best, 1)})
    keys = [f"h{i:08x}" for i in range(n)]
    timed("put_inline_4k", [encode(m.PutInline(client="h", item=m.PutItem(key=k, size=4096),
                                               value=val)) for k in keys])
    timed("get_replicas", [encode(m.GetReplicas(key=f"c{i:08x}")) for i in range(n)])
    timed("exists_hit", [encode(m.Exists(key=k)) for k in keys])
    timed("exists_miss", [encode(m.Exists(key="x" + k)) for k in keys])
    timed("remove_4k_held", [encode(m.Remove(key=k)) for k in keys])
    timed("remove_1MiB", [encode(m.Remove(key=f"c{i:08x}", force=True)) for i in range(n)])
    svc.server.close()
    return rows


def ab(before: str, after: str, rounds: int, n: int, service: bool = False) -> None:
    got: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
            src = before if which == "before" else after
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src), PYTHONHASHSEED="0")
            out = subprocess.run([sys.executable, __file__, "--n", str(n), "--json",
                                  *(["--service"] if service else [])], env=env,
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
    ap.add_argument("--service", action="store_true",
                    help="whole requests through MasterService (frame, dispatch, flush)")
    ns = ap.parse_args()
    if ns.ab:
        ab(*ns.ab, ns.rounds, ns.n, ns.service)
        return
    rows = measure_service(ns.n) if ns.service else measure(ns.n)
    if ns.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['op']:24} {r['ops_per_s']:12.0f}")


if __name__ == "__main__":
    main()
