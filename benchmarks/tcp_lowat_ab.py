"""Interleaved A/B of the TCP receiver's wake-up parts (`framing.LOWAT_PARTS`) on one inline
request — a store put's or get's data step — against a raw socket put / get RPC of the size.

One target process per variant (``--parts 1,4``: 1 = one wake-up for the whole run, the old
receive); each round runs the raw RPC and every variant for ``--seconds`` each, the order
reversed every other round. Prints, per op and variant, the median and spread of the rounds'
ratios to the raw RPC, and CPU µs per request of both ends.

    .venv/bin/python benchmarks/tcp_lowat_ab.py --size 1MiB --parts 1,4 --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

import yuebing.transfer.transport.framing as framing
from yuebing.core.config import parse_size
from yuebing.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from yuebing.transfer.bench import process_cpu_s
from yuebing.transfer.rawsock import RawClient, RawServer, rpc_loop

SEGMENT = 64 << 20
TARGET = ("import sys, yuebing.transfer.transport.framing as f; f.LOWAT_PARTS = int(sys.argv[1]); "
          "from yuebing.transfer.bench import serve; serve(int(sys.argv[2]))")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=1 << 20)
    ap.add_argument("--parts", default="1,4")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seconds", type=float, default=0.25, help="per variant and round")
    a = ap.parse_args()
    parts = [int(x) for x in a.parts.split(",")]
    targets = {}
    for p in parts:
        proc = subprocess.Popen([sys.executable, "-c", TARGET, str(p), str(SEGMENT)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        targets[p] = (proc, proc.stdout.readline().strip())
    raw = RawServer(SEGMENT, 4 << 20)
    rc = RawClient(raw.port, 4 << 20)
    eng = TransferEngine(TransferConfig(metadata="p2p", transports=("tcp",)))
    local = np.ones(a.size, np.uint8)
    ratios: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int | str], list[tuple[float, float]]] = {}

    def timed(key: tuple[str, int | str], pid: int, fn) -> float:  # type: ignore[no-untyped-def]
        c0 = process_cpu_s(), process_cpu_s(pid)
        n, took = fn()
        cpu.setdefault(key, []).append(((process_cpu_s() - c0[0]) / n * 1e6,
                                        (process_cpu_s(pid) - c0[1]) / n * 1e6))
        return n * a.size / took

    def engine(op: str, p: int) -> tuple[int, float]:
        framing.LOWAT_PARTS = p  # this process receives a read's payload
        req = [TransferRequest(OpCode.WRITE if op == "write" else OpCode.READ, local,
                               targets[p][1], 0)]
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.seconds or n < 3:
            eng.transfer_status(req, 30).raise_for_status()
            n += 1
        return n, time.perf_counter() - t0

    def rawrpc(op: str) -> tuple[int, float]:
        lat, took = rpc_loop(rc, op, [memoryview(local)], a.seconds)
        return len(lat), took

    try:
        for op in ("write", "read"):
            for p in parts:
                engine(op, p)  # warm
            for r in range(a.rounds):
                order: list[int | None] = [None, *parts]
                if r % 2:
                    order.reverse()
                rate: dict[int | None, float] = {}
                for p in order:
                    rate[p] = timed((op, "raw"), raw.proc.pid, lambda o=op: rawrpc(o)) \
                        if p is None else timed((op, p), targets[p][0].pid,
                                                lambda o=op, q=p: engine(o, q))
                for p in parts:
                    ratios.setdefault((op, p), []).append(rate[p] / rate[None])
        for (op, p), v in ratios.items():
            c = cpu[(op, p)]
            print(f"{op:5} parts={p:<3} vs raw median {statistics.median(v):.3f} "
                  f"(min {min(v):.3f}, max {max(v):.3f}); CPU µs/request initiator "
                  f"{statistics.median(x[0] for x in c):.0f}, target "
                  f"{statistics.median(x[1] for x in c):.0f}")
        for op in ("write", "read"):
            c = cpu[(op, "raw")]
            print(f"{op:5} raw RPC CPU µs/request client {statistics.median(x[0] for x in c):.0f}, "
                  f"server {statistics.median(x[1] for x in c):.0f}")
    finally:
        eng.close()
        rc.close()
        raw.close()
        for proc, _ in targets.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait()


if __name__ == "__main__":
    main()
