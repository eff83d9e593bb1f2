#!/usr/bin/env python3
"""Store local socket A/B: a same-host client's master calls through the master's Unix socket
(`store.wire.connect`, the default) against TCP (``ClientConfig(local_socket=False)``).

One master + one node (child processes, loopback) and two clients in this process, one per way,
taking turns in chunks of ``--chunk`` s, ``--rounds`` times (order swapped per round), so load
drifts hit both alike. Prints the median µs per call of each and the median of the rounds'
TCP / local ratios with their range (> 1: the local socket is faster). docs/benchmarks.md:

    .venv/bin/python benchmarks/store_local_socket_ab.py --rounds 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

OPS = ("exists", "exists_miss", "get_4k", "put_4k", "remove")


def main() -> None:
    from tqdm import tqdm

    from yuebing.core.spin import machine
    from yuebing.store.benchprocs import start_master, start_node
    from yuebing.store.client.client import StoreClient
    from yuebing.store.config import ClientConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)}")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--chunk", type=float, default=1.0, help="seconds per way, op and round")
    ap.add_argument("--json", default="", help="also write the results here")
    ns = ap.parse_args()
    ops = ns.ops.split(",")
    if bad := [o for o in ops if o not in OPS]:
        ap.error(f"unknown ops {bad}; choose from {','.join(OPS)}")
    if ns.rounds < 1 or ns.chunk <= 0:
        ap.error("--rounds must be >= 1 and --chunk > 0")

    mst = start_master()
    node = start_node(mst.info["address"], "1GiB")
    ways = {w: StoreClient(ClientConfig(master=mst.info["address"], checksum=False,
                                        local_socket=(w == "local")))
            for w in ("local", "tcp")}
    try:
        value = bytes(4096)
        for i in range(200):
            ways["local"].put(f"k4/{i}", value)
        for w, c in ways.items():
            c.exists("k4/0")
            assert c.rpc.sock is not None and c.rpc.sock.local == (w == "local"), w
        seq = iter(range(1 << 62))

        def op(name: str, c: Any, w: str) -> Callable[[], object]:
            def call() -> object:
                i = next(seq)
                if name == "exists":
                    return c.exists(f"k4/{i % 200}")
                if name == "exists_miss":
                    return c.exists(f"nope/{i}")
                if name == "get_4k":
                    return c.get(f"k4/{i % 200}")
                if name == "put_4k":
                    return c.put(f"{w}/p4/{i}", value)
                c.put(f"{w}/rm/{i}", value)  # remove: a put, then its removal (two calls)
                return c.remove(f"{w}/rm/{i}")
            return call

        res: dict[tuple[str, str], list[float]] = {}
        for r in tqdm(range(ns.rounds), desc="rounds"):
            order = ("local", "tcp") if r % 2 == 0 else ("tcp", "local")
            for name in ops:
                for w in order:
                    fn = op(name, ways[w], w)
                    fn()
                    n, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < ns.chunk:
                        fn()
                        n += 1
                    res.setdefault((name, w), []).append((time.perf_counter() - t0) / n * 1e6)
            for w in ways:
                ways["local"].remove_prefix(f"{w}/", force=True)
        out: dict[str, Any] = {"machine": str(machine()), "rounds": ns.rounds}
        for name in ops:
            loc, tcp = res[(name, "local")], res[(name, "tcp")]
            ratios = sorted(t / x for x, t in zip(loc, tcp, strict=True))
            out[name] = {"local_us": round(statistics.median(loc), 1),
                         "tcp_us": round(statistics.median(tcp), 1),
                         "tcp_over_local": round(statistics.median(ratios), 3),
                         "range": [round(ratios[0], 3), round(ratios[-1], 3)]}
            print(f"{name:12s} local {out[name]['local_us']:7.1f} µs  tcp "
                  f"{out[name]['tcp_us']:7.1f} µs  tcp/local {out[name]['tcp_over_local']:.3f} "
                  f"({out[name]['range'][0]:.3f}–{out[name]['range'][1]:.3f})")
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        for c in ways.values():
            c.close()
        node.stop()
        mst.stop()


if __name__ == "__main__":
    main()
