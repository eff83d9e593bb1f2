#!/usr/bin/env python3
"""CPU per remote put (or get) in each process, against the raw socket RPC, interleaved.

One master + one node (child processes, loopback) and one TCP-only client (`store_latency_ab.Rig`),
plus a raw socket server (`transfer.rawsock`). Rounds alternate the store call and the raw RPC
of the same value (order swapped per round) for ``--seconds`` each; per round: p10 / p50 µs per
call, and per process the CPU µs (``/proc/<pid>/task/*/schedstat``, exact run time, every thread),
its user / kernel split (``/proc/<pid>/stat``, clock ticks) and voluntary context switches (sleeps)
per call. CPU per call does not wait for a CPU, so it is what a loaded host still measures; p50
is not. Medians over rounds, and store ÷ raw of each.
``--steps``: a put's client-side steps (`StepTimer`), p50 µs, from one extra store-only round:

    .venv/bin/python benchmarks/store_put_cpu.py --op put --size 1MiB --rounds 6 --seconds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_latency_ab import Rig  # noqa: E402

from yuebing.core.config import parse_size  # noqa: E402
from yuebing.transfer.rawsock import RawClient, RawServer  # noqa: E402

SLOTS = 64
"""Values the store's keys and the raw server's slots walk (as `yuebing bench store --raw`)."""


def run_s(pid: int) -> float:
    """Seconds ``pid`` has run on a CPU, all its threads (live ones: a thread that ended since
    the last read drops out, so take both reads while the process is steady)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass
    return total / 1e9


TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def user_sys_s(pid: int) -> tuple[float, float]:
    """Seconds ``pid`` (all its threads) has run in user mode (Python, libraries) and in the
    kernel (copies, the network stack), at clock-tick resolution."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) * TICK_S, int(fields[12]) * TICK_S


def sleeps(pid: int) -> int:
    """Voluntary context switches of ``pid``, all its threads."""
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                n += sum(int(line.split()[1]) for line in f
                         if line.startswith("voluntary_ctxt_switches"))
        except FileNotFoundError:
            pass
    return n


def one_round(fn: Callable[[], object], pids: dict[str, int], seconds: float,
              every: int, tidy: Callable[[], object] | None) -> dict[str, float]:
    """Call ``fn`` for ``seconds`` (``tidy`` every ``every`` calls, outside the clock and
    the counts); µs per call and per-process CPU µs and sleeps per call."""
    fn()
    cpu0 = {k: run_s(p) for k, p in pids.items()}
    sw0 = {k: sleeps(p) for k, p in pids.items()}
    us0 = {k: user_sys_s(p) for k, p in pids.items()}
    lat: list[float] = []
    spent = 0.0
    while spent < seconds:
        a = time.perf_counter()
        fn()
        b = time.perf_counter()
        lat.append(b - a)
        spent += b - a
        if tidy is not None and len(lat) % every == 0:
            t_cpu = {k: run_s(p) for k, p in pids.items()}
            t_sw = {k: sleeps(p) for k, p in pids.items()}
            t_us = {k: user_sys_s(p) for k, p in pids.items()}
            tidy()
            for k, p in pids.items():  # its CPU and sleeps are not the calls'
                cpu0[k] += run_s(p) - t_cpu[k]
                sw0[k] += sleeps(p) - t_sw[k]
                u, s = user_sys_s(p)
                us0[k] = (us0[k][0] + u - t_us[k][0], us0[k][1] + s - t_us[k][1])
    n = len(lat)
    lat.sort()
    row = {"n": n, "p10_us": lat[n // 10] * 1e6, "p50_us": lat[n // 2] * 1e6}
    for k, p in pids.items():
        row[f"{k}_cpu_us"] = (run_s(p) - cpu0[k]) / n * 1e6
        row[f"{k}_sleeps"] = (sleeps(p) - sw0[k]) / n
        u, s = user_sys_s(p)
        row[f"{k}_user_us"] = (u - us0[k][0]) / n * 1e6
        row[f"{k}_sys_us"] = (s - us0[k][1]) / n * 1e6
    row["cpu_us"] = sum(row[f"{k}_cpu_us"] for k in pids)
    return row


class StepTimer:
    """Times a put's client steps by wrapping `StoreClient.transfer` / `commit` and the inline
    frame's `send_parts` (this process only, while `on`): before the transfer, the send of
    the write frame, the wait for the node's answer, the steps between, the wait for the
    master's answer to the commit, after it. Costs a few µs a put: kept off the rounds."""

    NAMES = ("before", "send", "node_answer", "between", "master_answer", "after")

    def __init__(self) -> None:
        from yuebing.store.client.client import StoreClient
        from yuebing.transfer.transport import tcp_inline

        self.t: dict[str, float] = {}
        self.rows: list[tuple[float, ...]] = []
        t = self.t
        transfer, commit, send = StoreClient.transfer, StoreClient.commit, tcp_inline.send_parts

        def timed_transfer(client: Any, *a: Any, **k: Any) -> Any:
            t["transfer"] = time.perf_counter()
            got = transfer(client, *a, **k)
            t["answered"] = time.perf_counter()
            return got

        def timed_commit(client: Any, *a: Any, **k: Any) -> Any:
            t["commit"] = time.perf_counter()
            got = commit(client, *a, **k)
            t["committed"] = time.perf_counter()
            return got

        def timed_send(*a: Any, **k: Any) -> Any:
            got = send(*a, **k)
            t["sent"] = time.perf_counter()
            return got

        StoreClient.transfer, StoreClient.commit = timed_transfer, timed_commit
        tcp_inline.send_parts = timed_send

    def put(self, fn: Callable[[], object]) -> None:
        """One put ``fn``, its steps kept when it went the commit-on-landing way."""
        t = self.t
        t.clear()
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        marks = ("transfer", "sent", "answered", "commit", "committed")
        if all(m in t for m in marks):
            points = [start, *(t[m] for m in marks), end]
            self.rows.append(tuple(b - a for a, b in zip(points, points[1:], strict=False)))

    def p50_us(self) -> dict[str, float]:
        return {n: round(statistics.median(r[i] for r in self.rows) * 1e6, 1)
                for i, n in enumerate(self.NAMES)} if self.rows else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("put", "get"), default="put")
    ap.add_argument("--size", default="1MiB")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=8.0, help="per side and round")
    ap.add_argument("--master-spin", type=int, default=-1, help="the master's --spin-us")
    ap.add_argument("--steps", action="store_true", help="also time a put's client steps")
    ap.add_argument("--json", default="", help="also write the rounds and medians here")
    ns = ap.parse_args()
    if ns.steps and ns.op != "put":
        ap.error("--steps times a put's client steps: it needs --op put")
    size = parse_size(ns.size)
    if ns.rounds < 1 or ns.seconds <= 0 or not 0 < size <= 4 << 20:
        raise SystemExit("--rounds >= 1, --seconds > 0, --size in 1..4MiB")
    rig = Rig(ns.master_spin)
    srv = RawServer(size * SLOTS)
    raw = RawClient(srv.port)
    try:
        c = rig.c
        views = [rig.src[i * size:(i + 1) * size].data for i in range(SLOTS)]
        dst = memoryview(bytearray(size))
        for i in range(SLOTS):
            c.put(f"g/{i}", views[i])
        k = [0]

        def store() -> object:
            k[0] += 1
            if ns.op == "get":
                return c.get_into(f"g/{k[0] % SLOTS}", dst)
            return c.put(f"x/{k[0]}", views[k[0] % SLOTS])

        def rawcall() -> None:
            k[0] += 1
            j = k[0] % SLOTS
            if ns.op == "get":
                raw.get(dst, j * size)
            else:
                raw.put(views[j], j * size)

        me = os.getpid()
        sides = {"store": (store, {"client": me, "node": rig.node.proc.pid,
                                   "master": rig.mst.proc.pid}),
                 "raw": (rawcall, {"client": me, "server": srv.proc.pid})}
        tidy = (lambda: c.remove_prefix("x/", force=True)) if ns.op == "put" else None
        rounds: dict[str, list[dict[str, float]]] = {"store": [], "raw": []}
        for r in range(ns.rounds):
            for side in ("store", "raw") if r % 2 == 0 else ("raw", "store"):
                fn, pids = sides[side]
                row = one_round(fn, pids, ns.seconds, 500, tidy if side == "store" else None)
                rounds[side].append(row)
                print(side, r, {a: round(b, 2) for a, b in row.items()}, flush=True)
            if tidy is not None:
                tidy()
        steps: dict[str, float] = {}
        if ns.steps and ns.op == "put":
            timer = StepTimer()
            end, calls = time.perf_counter() + ns.seconds, 0
            while time.perf_counter() < end:
                timer.put(store)
                calls += 1
                if calls % 500 == 0 and tidy is not None:
                    tidy()
            steps = timer.p50_us()
            print("put steps p50 µs", steps, flush=True)
    finally:
        raw.close()
        srv.close()
        rig.close()
    med = {side: {key: round(statistics.median(x[key] for x in rows), 2) for key in rows[0]}
           for side, rows in rounds.items()}
    ratio = {key: round(statistics.median(s[key] / w[key] for s, w in zip(
        rounds["store"], rounds["raw"], strict=True)), 3) for key in ("p50_us", "cpu_us")}
    print(json.dumps({"median": med, "store_over_raw": ratio}, indent=1))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"args": vars(ns), "rounds": rounds, "median": med,
                                             "store_over_raw": ratio, "put_steps_p50_us": steps},
                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
