"""Per-op cost of small remote store calls: N puts, gets, exists, removes of one value size (4 KiB by
default) from a client whose transfer engine is TCP only (every byte crosses loopback), against a
master and a node started as child processes, as in ``yuebing bench store``'s ``remote_tcp``.

Prints one JSON line: µs per put / get and each process's CPU µs per op (user and system, all its
threads; medians of ``--rounds``). ``--pids-to`` writes each process's pid, so a
profiler can attach to the master and the node during ``--hold`` seconds of each phase:

    .venv/bin/python benchmarks/store_small_ops.py --n 3000 --hold 0      # timing only
    # syscalls per op: strace -c -f -p <pid> for each process while a phase runs, / N
    # CPU per step: py-spy record --native -p <pid> (or run this under py-spy for the client)

``--pids-to FILE`` writes {"master": pid, "node": pid, "client": pid} before the first phase
and waits ``--hold`` seconds so attaching is done before any op is timed. ``--ab-inline`` runs
each phase twice per round, interleaved: a client whose small values the master holds (keys
``*_inline``) and one with that off (``*_segment``), and prints ``*_segment_over_inline``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from yuebing.core.config import parse_size
from yuebing.store.benchprocs import start_master, start_node
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig
from yuebing.transfer import TransferConfig, TransferEngine


def cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``, all threads (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="calls per phase")
    ap.add_argument("--size", default="4KiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", default="put,get,exists",
                    help="phases, in order, per round (put, get, exists, remove: of the keys put)")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="seconds to wait after writing --pids-to (attach a profiler)")
    ap.add_argument("--pids-to", default="")
    ap.add_argument("--checksum", action="store_true")
    ap.add_argument("--ab-inline", action="store_true",
                    help="A/B: the master holds small values (one RPC) vs every value on the node")
    ap.add_argument("--master-args", default="", help="extra flags of `yuebing store master`")
    ap.add_argument("--node-args", default="", help="extra flags of `yuebing store node`")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="the client's spin window (ClientConfig and TransferConfig)")
    ns = ap.parse_args()
    size = parse_size(ns.size)
    mst = start_master(*ns.master_args.split())
    node = start_node(mst.info["address"], "256MiB", *ns.node_args.split())
    spin = {} if ns.spin_us is None else {"spin_us": ns.spin_us}
    engine = TransferEngine(TransferConfig(metadata="p2p", transports=("tcp",), **spin))
    variants = {"_inline": -1, "_segment": 0} if ns.ab_inline else {"": -1}
    clients = {v: StoreClient(ClientConfig(
        master=mst.info["address"], checksum=ns.checksum, **spin,
        **({"inline_max_bytes": lim} if lim >= 0 else {})), engine=engine)
        for v, lim in variants.items()}
    val = os.urandom(size)
    res: dict[str, list[float]] = {op + v: [] for op in ns.ops.split(",") for v in variants}
    pids = {"client": os.getpid(), "master": mst.proc.pid, "node": node.proc.pid}
    cpu: dict[str, list[float]] = {f"{op}_{kind}_{who}": [] for op in res for who in pids
                                   for kind in ("usr", "sys")}
    try:
        for v, c in clients.items():
            for i in range(200):  # warm: connections, reservations
                c.put(f"w{v}/{i}", val)
                c.get(f"w{v}/{i}")
        if ns.pids_to:
            with open(ns.pids_to, "w") as f:
                json.dump({"master": mst.proc.pid, "node": node.proc.pid,
                           "client": os.getpid()}, f)
            time.sleep(ns.hold)
        for r, (v, c) in ((r, vc) for r in range(ns.rounds) for vc in clients.items()):
            keys = [f"k{v}/{r}/{i}" for i in range(ns.n)]
            for op in ns.ops.split(","):
                c0 = {who: cpu_s(pid) for who, pid in pids.items()}
                t = time.perf_counter()
                if op == "put":
                    for k in keys:
                        c.put(k, val)
                elif op == "exists":  # one master round trip: the floor of any remote op
                    for k in keys:
                        c.exists(k)
                elif op == "remove":  # forced: a get phase before it leaves read leases
                    for k in keys:
                        c.remove(k, force=True)
                else:
                    for k in keys:
                        c.get(k)
                res[op + v].append((time.perf_counter() - t) / ns.n * 1e6)
                for who, pid in pids.items():
                    (u1, s1), (u0, s0) = cpu_s(pid), c0[who]
                    cpu[f"{op}{v}_usr_{who}"].append((u1 - u0) / ns.n * 1e6)
                    cpu[f"{op}{v}_sys_{who}"].append((s1 - s0) / ns.n * 1e6)
            if "remove" not in ns.ops:
                c.batch_remove(keys, force=True)
    finally:
        for c in clients.values():
            c.close()
        node.stop()
        mst.stop()
    med = {op: statistics.median(x) for op, x in res.items()}
    ab = {f"{op}_segment_over_inline": round(med[f"{op}_segment"] / med[f"{op}_inline"], 2)
          for op in ns.ops.split(",")} if ns.ab_inline else {}
    print(json.dumps({"size": size, "n": ns.n, **ab,
                      **{f"{op}_us": round(statistics.median(v), 1) for op, v in res.items()},
                      **{k: round(statistics.median(v), 1) for k, v in cpu.items()},
                      **{f"{op}_us_rounds": [round(x, 1) for x in v] for op, v in res.items()}}))


if __name__ == "__main__":
    main()
