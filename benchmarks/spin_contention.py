"""What spinning costs on a contended CPU: a request/answer ping-pong between two processes over a
socket pair (each side does a few µs of Python per message, as the store's client and master do),
the waiting side either spinning with `core.spin.Spinner` as the store's RPC does, or always
sleeping in ``poll``. Modes alternate per round.

    .venv/bin/python benchmarks/spin_contention.py --rounds 5                 # as the machine is
    .venv/bin/python benchmarks/spin_contention.py --rounds 5 --busy 2 --nice 19   # beside busy tasks

``--busy N`` starts N busy-loop processes for the run; ``--nice`` renices the ping-pong itself.
Prints one JSON line: per mode the median µs per round trip, CPU µs and involuntary switches per
round trip (of the timing process), and ``*_over_block`` ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from yuebing.core import spin

MODES = ("spin", "block")


def _work() -> int:
    x = 0
    for i in range(200):  # a few µs of Python per message
        x += i
    return x


def _waiter(sock: socket.socket, mode: str, window_s: float) -> Callable[[], None]:
    p = select.poll()
    p.register(sock, select.POLLIN)
    s = spin.Spinner()

    def wait() -> None:
        if mode == "block" or not s.wait(lambda: p.poll(0), window_s):
            p.poll(1000)
    return wait


def one(mode: str, n: int, window_s: float) -> dict[str, float]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    pid = os.fork()
    if pid == 0:  # the answering side
        wait = _waiter(b, mode, window_s)
        for _ in range(n):
            wait()
            b.recv(64)
            _work()
            b.send(b"y")
        os._exit(0)
    wait = _waiter(a, mode, window_s)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    for _ in range(n):
        a.send(b"x")
        wait()
        a.recv(64)
        _work()
    dt = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    os.waitpid(pid, 0)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return {"us": dt / n * 1e6, "cpu_us": cpu / n * 1e6, "nivcsw": (r1.ru_nivcsw - r0.ru_nivcsw) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="round trips per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--window-us", type=int, default=200)
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside it")
    ap.add_argument("--nice", type=int, default=0, help="niceness added to the ping-pong")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.one:
        print(json.dumps(one(ns.one, ns.n, ns.window_us * 1e-6)))
        return
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(ns.busy)]
    res: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for r in range(ns.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                out = subprocess.run(
                    ["nice", "-n", str(ns.nice), sys.executable, __file__, "--one", mode,
                     "--n", str(ns.n), "--window-us", str(ns.window_us)],
                    check=True, capture_output=True, text=True).stdout
                res[mode].append(json.loads(out))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in res.items()}
    print(json.dumps({
        "busy": ns.busy, "nice": ns.nice,
        **{f"{m}_{k}": round(v, 2) for m, d in med.items() for k, v in d.items()},
        "spin_over_block": round(med["spin"]["us"] / med["block"]["us"], 2),
        "rounds_us": {m: [round(x["us"], 1) for x in v] for m, v in res.items()}}))


if __name__ == "__main__":
    main()
