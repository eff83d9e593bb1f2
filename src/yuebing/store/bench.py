"""``yuebing bench store``: put/get/batch/zero-copy and metadata-op benchmarks.

Two processes hold the data path, like the original's ``remote_tcp`` variant: a storage node
(process A, started here with its master) holds the DRAM segment; this process (B) is the client.
Path ``remote_tcp`` forces the client's transfer engine onto TCP (every byte crosses a loopback
socket) and its master calls too (as from another host: no local socket); ``same_host`` lets it
use shared memory and the master's local socket. Per value size and API pair, each run writes
about ``--target-bytes`` of fresh keys (at least 32 calls single / 4 batched, at most 4096, capped
at ``--time-cap`` s), reads them back (one value's content checked), then force-removes them.
Metadata ops use 4 KiB values. A warm-up writes ``--warm-bytes`` first so first-touch page
faults are not counted (as the original's harness does). Rows: {path, op, size_bytes, batch,
gbps, ops_per_s, p50_us, p99_us} (median throughput of the runs, pooled latency percentiles).
With ``--raw``, each ``remote_tcp`` run of a single-value pair alternates with as many raw
socket put / get RPCs of the value (`yuebing.transfer.rawsock`): rows ``raw_<op>`` put call i
into slot i of the server's buffer and get it back, walking as much memory as the store's run
does in its node's segment (a value per key), and rows ``raw_hot_<op>`` use one cache-hot slot
for every call (a cache-hot reference that flatters the raw side). The pair's rows get
``vs_raw`` (median of the runs' ratios to the walking raw RPC) and its spread ``vs_raw_min`` /
``vs_raw_max``, and ``vs_raw_hot`` (the same median against the one-slot raw RPC).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from yuebing.core.config import format_size, parse_size, parse_size_list
from yuebing.transfer.rawsock import RawClient, RawServer, rpc_loop

PAIRS = {"single": ("put", "get", 1), "batch": ("batch_put", "batch_get", 0),
         "zc": ("put_from", "get_into", 1), "zcbatch": ("batch_put_from", "batch_get_into", 0)}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="64KiB,1MiB,4MiB,16MiB", help="value sizes, comma-separated")
    p.add_argument("--paths", default="remote_tcp,same_host", help="remote_tcp,same_host")
    p.add_argument("--pairs", default="single,batch,zc,zcbatch", help="API pairs to run")
    p.add_argument("--batch", type=int, default=16, help="keys per batch call")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--target-bytes", default="512MiB", help="bytes per put phase of one run")
    p.add_argument("--time-cap", type=float, default=5.0, help="seconds cap of one phase")
    p.add_argument("--warm-bytes", default="2GiB", help="written and removed before measuring")
    p.add_argument("--dram", default="2GiB", help="DRAM segment of the node process")
    p.add_argument("--meta-ops", type=int, default=2000, help="calls per metadata-op run")
    p.add_argument("--skip-data", action="store_true")
    p.add_argument("--skip-meta", action="store_true")
    p.add_argument("--no-checksum", action="store_true", help="skip value checksums")
    p.add_argument("--keep-freed", type=parse_size, default=1 << 30,
                   help="the client's glibc keep-freed heap (ClientConfig.keep_freed; the bench "
                        "process has nothing else to disturb); 0 = malloc defaults")
    p.add_argument("--no-direct", action="store_true",
                   help="same_host: copy through the transfer engine, not the direct shm path")
    p.add_argument("--no-reserve-ahead", action="store_true",
                   help="every put in two phases (put_start + put_end RPCs), not a write into "
                        "space the master reserved ahead + one put_commit RPC "
                        "(ClientConfig.reserve_ahead)")
    p.add_argument("--no-commit-on-landing", action="store_true",
                   help="a remote put into a reservation sends its commit RPC after the write, "
                        "not on the write frame for the node to hand on "
                        "(ClientConfig.commit_on_landing)")
    p.add_argument("--raw", action="store_true",
                   help="remote_tcp single-value pairs: alternate each run with raw Python socket "
                        "put/get RPCs of the same value (rows raw_<op>, vs_raw and its spread)")
    p.add_argument("--no-inline", action="store_true",
                   help="never ask the master to hold a small value itself (one put RPC, the "
                        "value in a get's reply); every put writes to a node "
                        "(ClientConfig.inline_max_bytes=0)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    p.add_argument("--out", default="", help="also write the JSON rows to this file")


def _pct(lat: list[float], p: float) -> float:
    return float(np.percentile(lat, p)) * 1e6 if lat else float("nan")


def _round(x: float, decimals: int) -> float:
    """``x`` to ``decimals`` places, or to 3 significant digits where that would show a
    positive rate as 0 (one run starved of CPU makes a ratio of 1e-4)."""
    if x <= 0 or x >= 10.0 ** -decimals:
        return round(x, decimals)
    return round(x, 2 - math.floor(math.log10(x)))


class Bench:
    """One client (process B) against one master + node (process A)."""

    def __init__(self, ns: argparse.Namespace, client: Any, path: str,
                 raw: RawClient | None = None) -> None:
        self.ns, self.c, self.path = ns, client, path
        self.raw = raw
        """The raw socket reference's connection (``--raw``, path ``remote_tcp``)."""
        self.sizes = parse_size_list(ns.sizes)
        self.batch = ns.batch
        slab = self.batch * max(self.sizes)
        rng = np.random.default_rng(12345)
        self.src = rng.integers(0, 256, slab, dtype=np.uint8)
        self.dst = np.ones(slab, dtype=np.uint8)
        self.rows: list[dict[str, Any]] = []

    def cell(self, op: str, size: int, batch: int, runs: list[tuple[list[float], float, int]]) -> None:
        lat = sorted(x for r in runs for x in r[0])
        gbps = statistics.median(r[2] * size / r[1] / 1e9 if r[1] else 0.0 for r in runs)
        ops = statistics.median(r[2] / r[1] if r[1] else 0.0 for r in runs)
        self.rows.append({"path": self.path, "op": op, "size_bytes": size, "batch": batch,
                          "gbps": _round(gbps, 4), "ops_per_s": _round(ops, 1),
                          "p50_us": round(_pct(lat, 50), 1), "p99_us": round(_pct(lat, 99), 1)})

    def warmup(self) -> None:
        chunk = min(16 << 20, max(self.sizes))
        keys = [f"warm/{i}" for i in range(parse_size(self.ns.warm_bytes) // chunk)]
        for k in keys:
            self.c.put_from(k, self.src[:chunk])
        self.c.batch_remove(keys, force=True)

    def _calls(self, size: int, batch: int) -> int:
        return calls(self.ns, size, batch)

    def pair(self, pair: str, size: int, run: int) -> tuple[tuple, tuple]:
        put_name, get_name, single = PAIRS[pair]
        b = 1 if single else self.batch
        c, src, dst = self.c, self.src, self.dst
        vals = [bytes(src[j * size:(j + 1) * size]) for j in range(b)] if pair in (
            "single", "batch") else [src[j * size:(j + 1) * size] for j in range(b)]
        outs = [dst[j * size:(j + 1) * size] for j in range(b)]
        n = self._calls(size, b)
        written: list[list[str]] = []

        def put(i: int) -> None:
            ks = [f"{pair}/{size}/{run}/{i}/{j}" for j in range(b)]
            if b == 1:
                c.put(ks[0], vals[i % len(vals)])
            elif any(c.batch_put(ks, vals)):
                raise RuntimeError("batch put failed")
            written.append(ks)

        def get(i: int) -> None:
            ks = written[i]
            if pair == "single":
                c.get(ks[0])
            elif pair == "zc":
                c.get_into(ks[0], outs[0])
            elif pair == "batch":
                c.batch_get(ks)
            elif min(c.batch_get_into(ks, outs)) < 0:
                raise RuntimeError("batch get failed")

        p = self._loop(put, n)
        g = self._loop(get, len(written))
        if not np.array_equal(np.frombuffer(c.get(written[0][0]), dtype=np.uint8), src[:size]):
            raise RuntimeError(f"content check failed for {pair} {size}")
        c.batch_remove([k for ks in written for k in ks], force=True)
        return (put_name, b, (p[0], p[1], p[2] * b)), (get_name, b, (g[0], g[1], g[2] * b))

    def _loop(self, fn: Callable[[int], None], n: int) -> tuple[list[float], float, int]:
        lat: list[float] = []
        start = time.perf_counter()
        cap = start + self.ns.time_cap
        for i in range(n):
            t0 = time.perf_counter()
            fn(i)
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            if t1 > cap:
                break
        return lat, time.perf_counter() - start, len(lat)

    def raw_pair(self, pair: str, size: int) -> tuple[tuple, ...]:
        """As many raw socket put and get RPCs of one value as `pair` makes calls: into and
        out of n slots of the server's buffer (as the store's n keys take n ranges of its
        node's segment), then of one slot (``raw_hot_``: the server's buffer stays cached)."""
        assert self.raw is not None
        put_name, get_name, _ = PAIRS[pair]
        n = self._calls(size, 1)
        out: list[tuple] = []
        for prefix, slots in (("raw_", n), ("raw_hot_", 1)):
            p = rpc_loop(self.raw, "put", [self.src[:size].data] * slots, 0.0, n)
            g = rpc_loop(self.raw, "get", [self.dst[:size].data] * slots, 0.0, n)
            out += [(f"{prefix}{put_name}", 1, (*p, n)), (f"{prefix}{get_name}", 1, (*g, n))]
        return tuple(out)

    def data(self, progress: Any) -> None:
        for size in self.sizes:
            for pair in [p.strip() for p in self.ns.pairs.split(",") if p.strip()]:
                raw = self.raw is not None and PAIRS[pair][2] == 1
                cells: dict[str, tuple[int, list]] = {}
                for run in range(self.ns.runs):  # the raw reference first in odd runs
                    order = ("raw", "yb") if raw and run % 2 else ("yb", "raw") if raw else ("yb",)
                    for who in order:
                        got = self.raw_pair(pair, size) if who == "raw" else \
                            self.pair(pair, size, run)
                        for op, b, r in got:
                            cells.setdefault(op, (b, []))[1].append(r)
                for op, (b, runs) in cells.items():
                    self.cell(op, size, b, runs)
                    if raw and not op.startswith("raw_"):
                        self._vs_raw(runs, cells[f"raw_{op}"][1], cells[f"raw_hot_{op}"][1])
                progress()

    def _vs_raw(self, runs: list[tuple], raw: list[tuple], hot: list[tuple]) -> None:
        """The last row's ratio to the raw RPC walking as much memory (median of the runs'
        ratios, and its spread) and to the one-slot raw RPC (median)."""
        def ratios(ref: list[tuple]) -> list[float]:
            return [(r[2] / r[1]) / (q[2] / q[1]) if r[1] and q[1] and q[2] else 0.0
                    for r, q in zip(runs, ref, strict=True)]
        walk = ratios(raw)
        self.rows[-1].update(vs_raw=_round(statistics.median(walk), 3),
                             vs_raw_min=_round(min(walk), 3), vs_raw_max=_round(max(walk), 3),
                             vs_raw_hot=_round(statistics.median(ratios(hot)), 3))

    def meta(self, progress: Any) -> None:
        cells: dict[str, tuple[int, int, list]] = {}
        for run in range(self.ns.runs):
            for op, size, b, r in self._meta_run(run):
                cells.setdefault(op, (size, b, []))[2].append(r)
            self.c.remove_all(force=True)
        for op, (size, b, runs) in cells.items():
            self.cell(op, max(size, 1), b, runs)
            if not size:
                self.rows[-1]["size_bytes"] = 0
                self.rows[-1]["gbps"] = 0.0
        progress()

    def _meta_run(self, run: int) -> list[tuple[str, int, int, tuple]]:
        c, n, B = self.c, self.ns.meta_ops, self.batch
        val = self.src[:4096].tobytes()
        keys = [f"meta/{run}/{i}" for i in range(n)]
        rm = [f"rm/{run}/{i}" for i in range(n)]
        tests: list[tuple[str, int, int, Callable[[int], Any], int]] = [
            ("put_4k", 4096, 1, lambda i: c.put(keys[i], val), n),
            ("get_4k", 4096, 1, lambda i: c.get(keys[i]), n),
            ("exists_hit", 0, 1, lambda i: c.exists(keys[i]), n),
            ("exists_miss", 0, 1, lambda i: c.exists(f"no/{i}"), n),
            ("batch_exists", 0, B, lambda i: c.batch_exists(
                [keys[(i * B + j) % n] for j in range(B)]), max(1, n // B)),
            ("remove", 0, 1, lambda i: c.remove(rm[i]), n),
        ]
        out: list[tuple[str, int, int, tuple]] = []
        stored = n
        for op, size, b, fn, calls in tests:
            if op == "remove":  # written untimed and never read: no lease blocks removal
                for k in rm:
                    c.put(k, val)
            if op in ("get_4k", "exists_hit"):  # only the keys put before --time-cap
                calls = min(calls, stored)
            lat, secs, done = self._loop(fn, calls)
            if op == "put_4k":
                stored = done
            out.append((op, size, b, (lat, secs, done * b)))
        return out


def _client(ns: argparse.Namespace, master: str, path: str) -> Any:
    from yuebing.store.client.client import StoreClient
    from yuebing.store.config import INLINE_MAX_BYTES, ClientConfig
    from yuebing.transfer import TransferConfig, TransferEngine

    transports = ("tcp",) if path == "remote_tcp" else ("shm", "tcp")
    engine = TransferEngine(TransferConfig(metadata="p2p", transports=transports))
    return StoreClient(ClientConfig(master=master, checksum=not ns.no_checksum,
                                    direct=not ns.no_direct, keep_freed=ns.keep_freed,
                                    reserve_ahead=not ns.no_reserve_ahead,
                                    commit_on_landing=not ns.no_commit_on_landing,
                                    inline_max_bytes=0 if ns.no_inline else INLINE_MAX_BYTES,
                                    local_socket=path != "remote_tcp"),
                       engine=engine)


def _start(ns: argparse.Namespace) -> tuple[list[Any], str]:
    from yuebing.store.benchprocs import start_master, start_node

    mst = start_master()
    try:
        node = start_node(mst.info["address"], ns.dram)
    except BaseException:  # the master must not outlive a node that never came up
        mst.stop()
        raise
    return [node, mst], mst.info["address"]


def calls(ns: argparse.Namespace, size: int, batch: int) -> int:
    """Calls of one run's put phase of ``batch`` × ``size`` (`--target-bytes` of fresh keys)."""
    lo = 32 if batch == 1 else 4
    return max(lo, min(4096, parse_size(ns.target_bytes) // (size * batch)))


def run_bench(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    paths = [p.strip() for p in ns.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in ("remote_tcp", "same_host")]
    if bad or ns.batch < 1 or ns.runs < 1:
        raise SystemExit(f"bad --paths {bad} / --batch / --runs")
    procs, master = _start(ns)
    raw: RawServer | None = None
    rows: list[dict[str, Any]] = []
    steps = len(paths) * ((0 if ns.skip_data else len(parse_size_list(ns.sizes))
                           * len(ns.pairs.split(","))) + (0 if ns.skip_meta else 1))
    try:
        if ns.raw and "remote_tcp" in paths:  # a slot per call of a run; 4 MiB: the
            raw = RawServer(max(calls(ns, s, 1) * s  # engine's socket_buffer
                                for s in parse_size_list(ns.sizes)), 4 << 20)
        with Progress(console=Console(stderr=True), transient=ns.json) as prog:
            task = prog.add_task("bench store", total=steps)
            for path in paths:
                c = _client(ns, master, path)
                rc = RawClient(raw.port, 4 << 20) if raw and path == "remote_tcp" else None
                try:
                    b = Bench(ns, c, path, rc)
                    b.warmup()
                    if not ns.skip_data:
                        b.data(lambda: prog.advance(task))
                    if not ns.skip_meta:
                        b.meta(lambda: prog.advance(task))
                    rows.extend(b.rows)
                finally:
                    c.close()
                    if rc is not None:
                        rc.close()
    finally:
        for p in procs:
            p.stop()
        if raw is not None:
            raw.close()
    _report(ns, rows)
    return 0


def _report(ns: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(rows, f, indent=1)
    if ns.json:
        print(json.dumps(rows))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="yuebing store")
    for col in ("path", "op", "size", "batch", "GB/s", "ops/s", "p50 us", "p99 us",
                "vs raw (min-max)", "vs raw hot"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["path"], r["op"], format_size(r["size_bytes"]), str(r["batch"]),
                  f"{r['gbps']:.3f}", f"{r['ops_per_s']:.0f}", f"{r['p50_us']:.0f}",
                  f"{r['p99_us']:.0f}", f"{r['vs_raw']:.2f} ({r['vs_raw_min']:.2f}-"
                  f"{r['vs_raw_max']:.2f})" if "vs_raw" in r else "",
                  f"{r['vs_raw_hot']:.2f}" if "vs_raw_hot" in r else "")
    Console().print(t)
