"""``yuebing bench transfer``: bandwidth and latency of the transfer engine between two processes.

`run_bench` starts a target process (``python -m yuebing.transfer.bench BYTES``: `serve`, one
pre-faulted shared-memory segment in P2P mode); for every cell (transport, op, size, batch,
lanes) it builds an engine restricted to that transport, warms the path up and submits batches
back to back for ``duration_s`` (`measure_cell`). A row: GB/s (1e9 payload bytes per wall
second), p50/p99 batch latency in µs, wall time per request. References, alternated with the
engine in rounds of the same working set: single-thread memcpy (`copy_bytes`) for shm cells
(``vs_memcpy``), a raw Python socket RPC (`rawsock`, ``raw_rounds``) for TCP cells (``vs_raw``:
the median of the per-round ratios, with their lowest and highest).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from yuebing.core.config import require
from yuebing.core.errors import TransferError
from yuebing.transfer.config import TransferConfig
from yuebing.transfer.engine import TransferEngine
from yuebing.transfer.lanes import start_target, stop_target
from yuebing.transfer.rawsock import RawClient, RawServer, interleave, rpc_loop
from yuebing.transfer.streamcopy import small_copy
from yuebing.transfer.types import OpCode, TransferRequest

SEGMENT = "bench"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    """What `run_bench` measures."""

    sizes: tuple[int, ...] = (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
    batch: int = 16
    lanes: tuple[int, ...] = (-1,)
    """TCP lane counts; -1: this machine's choice (`transfer.lanes`), shown as its number."""
    ops: tuple[str, ...] = ("write", "read")
    transports: tuple[str, ...] = ("tcp", "shm")
    duration_s: float = 1.0
    max_inflight: int = 256 << 20
    """Cap of bytes per batch: big sizes use fewer requests per batch (at least 1)."""
    small_batch: int = 128
    """Extra cells per transport, op and lane count: 64 KiB requests in batches of this many
    (0 = skip)."""
    slice_size: int = 1 << 20
    socket_buffer: int = 4 << 20
    memcpy: bool = True
    raw_rounds: int = 0
    """TCP cells alternate with a raw Python socket RPC of one request's size in this many
    rounds (each side ``duration_s / raw_rounds`` a round); 0 = no raw reference."""

    def __post_init__(self) -> None:
        require(len(self.sizes) > 0 and all(s >= 4096 for s in self.sizes),
                f"sizes must be >= 4KiB, got {self.sizes}")
        require(self.batch >= 1, f"batch must be >= 1, got {self.batch}")
        require(len(self.lanes) > 0 and all(n == -1 or 1 <= n <= 64 for n in self.lanes),
                f"lanes must be in 1..64 or -1 (this machine's choice), got {self.lanes}")
        require(bool(self.ops) and set(self.ops) <= {"read", "write"},
                f"ops must be read and/or write, got {self.ops}")
        require(bool(self.transports) and set(self.transports) <= {"tcp", "shm"},
                f"transports must be tcp and/or shm, got {self.transports}")
        require(self.duration_s > 0, f"duration_s must be > 0, got {self.duration_s}")
        require(self.small_batch >= 0, f"small_batch must be >= 0, got {self.small_batch}")
        require(0 <= self.raw_rounds <= 1000, f"raw_rounds must be in 0..1000, got {self.raw_rounds}")
        require(self.max_inflight >= max(self.sizes),
                f"max_inflight ({self.max_inflight}) must be >= the largest size")

    def batch_for(self, size: int) -> int:
        return max(1, min(self.batch, self.max_inflight // size))

    def cells(self) -> list[tuple[str, str, int, int, int]]:
        """(transport, op, size, batch, lanes) in measuring order; shm has no lanes."""
        out = []
        for transport in self.transports:
            lanes_list = self.lanes if transport == "tcp" else (1,)
            for op in self.ops:
                for lanes in lanes_list:
                    out += [(transport, op, s, self.batch_for(s), lanes) for s in self.sizes]
                if self.small_batch:
                    out += [(transport, op, 64 << 10, self.small_batch, n) for n in lanes_list]
        return out

    def segment_bytes(self) -> int:
        return max(max(s * self.batch_for(s) for s in self.sizes), (64 << 10) * self.small_batch)


@dataclass
class Row:
    """One measured cell."""

    transport: str
    op: str
    size_bytes: int
    batch: int
    lanes: int
    gbps: float
    p50_us: float
    p99_us: float
    per_request_us: float = 0.0
    samples: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        return d


def serve(segment_bytes: int) -> None:
    """Body of the target process: serve one pre-faulted segment, print its P2P name on stdout,
    and exit when stdin closes (the initiator finished or died)."""
    engine = TransferEngine(TransferConfig(metadata="p2p", lanes=1))  # it never initiates
    engine.register_segment(SEGMENT, size=segment_bytes, prefault=True)
    print(engine.segment_name(SEGMENT), flush=True)
    try:
        sys.stdin.read()
    finally:
        engine.close()


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0


PAIRS = 4
"""A shared-memory cell alternates this many slices of engine time and memcpy time."""


def _timed_batches(engine: TransferEngine, reqs: list[TransferRequest],
                   duration_s: float) -> tuple[list[float], float]:
    """Submit ``reqs`` as one batch, back to back, for ``duration_s`` (at least 3 times);
    returns the batch latencies and the elapsed time."""
    lat: list[float] = []
    start = now = time.perf_counter()
    while now < start + duration_s or len(lat) < 3:
        t0 = time.perf_counter()
        bid = engine.submit(reqs)
        st = engine.wait(bid)
        engine.free(bid)
        st.raise_for_status()
        now = time.perf_counter()
        lat.append(now - t0)
    return lat, now - start


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process or by process ``pid``."""
    if pid is None:  # CLOCK_PROCESS_CPUTIME_ID: ns resolution (os.times counts 10 ms ticks)
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_cell(remote: str, transport: str, op: str, size: int, batch: int, lanes: int,
                 cfg: BenchConfig, local: np.ndarray, pair_memcpy: bool = False,
                 target_pid: int | None = None, raw_port: int = 0) -> Row:
    """Run one cell against the target segment ``remote`` and return its row. With
    ``pair_memcpy`` the measurement alternates with single-thread memcpy of the same size
    through the same working set (size × batch), so both see the same machine load and caches;
    the row gets ``memcpy_gbps`` and ``vs_memcpy``. CPU time spent per request while the engine
    ran is recorded for this process (``cpu_us_initiator``) and, given ``target_pid``, for the
    target (``cpu_us_target``): what a request costs, whatever else the machine is doing.
    With ``raw_port`` (a `RawServer`) the engine alternates with raw socket RPCs of ``size``
    through the same views in ``cfg.raw_rounds`` rounds (`_vs_raw`)."""
    engine = TransferEngine(TransferConfig(
        metadata="p2p", transports=(transport,), lanes=lanes, slice_size=cfg.slice_size,
        socket_buffer=cfg.socket_buffer, connect_timeout_s=30.0))
    lanes = engine.config.lanes  # this machine's choice where -1 was asked
    try:
        opcode = OpCode.WRITE if op == "write" else OpCode.READ
        reqs = [TransferRequest(opcode, local[i * size:(i + 1) * size], remote, i * size)
                for i in range(batch)]
        for _ in range(2):
            engine.transfer(reqs, inline=False)  # warm the lanes the cell measures
        if raw_port:
            return _vs_raw(engine, reqs, Row(transport, op, size, batch, lanes, 0.0, 0.0, 0.0),
                           cfg, raw_port, target_pid)
        lat, elapsed, ref_bytes, ref_s, cpu = [], 0.0, 0, 0.0, [0.0, 0.0]
        bufs = (np.ones(size * batch, np.uint8), np.ones(size * batch, np.uint8)) \
            if pair_memcpy else None
        for _ in range(PAIRS if pair_memcpy else 1):
            c0 = process_cpu_s(), process_cpu_s(target_pid) if target_pid else 0.0
            part, took = _timed_batches(engine, reqs, cfg.duration_s / (PAIRS if bufs else 1))
            cpu[0] += process_cpu_s() - c0[0]
            cpu[1] += (process_cpu_s(target_pid) - c0[1]) if target_pid else 0.0
            lat += part
            elapsed += took
            if bufs is not None:
                moved, spent = _memcpy_passes(size, bufs, cfg.duration_s / PAIRS)
                ref_bytes, ref_s = ref_bytes + moved, ref_s + spent
        row = Row(transport, op, size, batch, lanes, len(lat) * batch * size / elapsed / 1e9,
                  _percentile(lat, 50) * 1e6, _percentile(lat, 99) * 1e6,
                  elapsed / (len(lat) * batch) * 1e6, len(lat))
        row.extra["cpu_us_initiator"] = round(cpu[0] / (len(lat) * batch) * 1e6, 2)
        if target_pid:
            row.extra["cpu_us_target"] = round(cpu[1] / (len(lat) * batch) * 1e6, 2)
        if pair_memcpy:
            row.extra["memcpy_gbps"] = round(ref_bytes / ref_s / 1e9, 3)
            row.extra["vs_memcpy"] = round(row.gbps * ref_s * 1e9 / ref_bytes, 3)
        return row
    finally:
        engine.close()


def _vs_raw(engine: TransferEngine, reqs: list[TransferRequest], row: Row, cfg: BenchConfig,
            raw_port: int, target_pid: int | None) -> Row:
    """Fill ``row`` from ``cfg.raw_rounds`` rounds alternating the engine's batches with raw
    socket RPCs (`rawsock.rpc_loop`: one request's size, the same local views and remote
    offsets, one after the other); ``vs_raw`` is the median of the rounds' engine ÷ raw rates,
    ``vs_raw_min`` / ``vs_raw_max`` their spread."""
    slice_s = cfg.duration_s / cfg.raw_rounds
    views = [memoryview(r.local) for r in reqs]  # type: ignore[arg-type]
    lat: list[float] = []
    raw_lat: list[float] = []
    took = [0.0, 0.0, 0.0]  # engine seconds, initiator CPU, target CPU
    raw = RawClient(raw_port, cfg.socket_buffer)

    def engine_round() -> float:
        c0 = process_cpu_s(), process_cpu_s(target_pid) if target_pid else 0.0
        part, spent = _timed_batches(engine, reqs, slice_s)
        took[1] += process_cpu_s() - c0[0]
        took[2] += (process_cpu_s(target_pid) - c0[1]) if target_pid else 0.0
        lat.extend(part)
        took[0] += spent
        return len(part) * len(reqs) * row.size_bytes / spent

    def raw_round() -> float:
        part, spent = rpc_loop(raw, row.op, views, slice_s)
        raw_lat.extend(part)
        return len(part) * row.size_bytes / spent

    try:
        rpc_loop(raw, row.op, views, 0.0, len(views))  # warm: connection and buffers
        res = interleave(engine_round, raw_round, cfg.raw_rounds)
    finally:
        raw.close()
    n = len(lat) * len(reqs)
    row.gbps = n * row.size_bytes / took[0] / 1e9
    row.p50_us, row.p99_us = _percentile(lat, 50) * 1e6, _percentile(lat, 99) * 1e6
    row.per_request_us, row.samples = took[0] / n * 1e6, len(lat)
    row.extra.update(cpu_us_initiator=round(took[1] / n * 1e6, 2),
                     raw_gbps=round(res.b / 1e9, 3), raw_p50_us=round(_percentile(raw_lat, 50) * 1e6, 1),
                     vs_raw=round(res.ratio, 3), vs_raw_min=round(res.ratio_min, 3),
                     vs_raw_max=round(res.ratio_max, 3), raw_rounds=res.rounds)
    if target_pid:
        row.extra["cpu_us_target"] = round(took[2] / n * 1e6, 2)
    return row


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """The single-thread memcpy reference: memoryview assignment up to `small_copy`,
    ``numpy.copyto`` (glibc memcpy) above — the transport's own copies above `small_copy` use
    streaming stores (`yuebing.transfer.streamcopy`) where the extension is built."""
    if len(src) <= small_copy():
        memoryview(dst)[:] = memoryview(src)  # type: ignore[arg-type]
    else:
        np.copyto(dst, src)


def _memcpy_passes(size: int, bufs: tuple[np.ndarray, np.ndarray],
                   duration_s: float) -> tuple[int, float]:
    """Copy ``bufs[1]`` → ``bufs[0]`` in ``size`` pieces for ``duration_s`` (at least 3 passes);
    returns (bytes moved, seconds spent)."""
    dst, src = bufs
    pieces = [(dst[i:i + size], src[i:i + size]) for i in range(0, len(dst) - size + 1, size)]
    passes, spent = 0, 0.0
    while spent < duration_s or passes < 3:
        t0 = time.perf_counter()
        for d, s in pieces:
            copy_bytes(d, s)
        spent += time.perf_counter() - t0
        passes += 1
    return passes * len(pieces) * size, spent


def measure_memcpy(sizes: Iterable[int], duration_s: float, working_set: int) -> list[Row]:
    """Single-thread copies (`copy_bytes`) of each size through a warm working set (both
    buffers touched first, so no page faults are timed); timed per pass over the working set."""
    src = np.ones(working_set, np.uint8)
    dst = np.ones(working_set, np.uint8)
    rows = []
    for size in sizes:
        pieces = [(dst[i:i + size], src[i:i + size])
                  for i in range(0, working_set - size + 1, size)]
        passes: list[float] = []
        start = time.perf_counter()
        while time.perf_counter() - start < duration_s or len(passes) < 3:
            t0 = time.perf_counter()
            for d, s in pieces:
                copy_bytes(d, s)
            passes.append(time.perf_counter() - t0)
        per_copy = [p / len(pieces) for p in passes]
        moved = len(passes) * len(pieces) * size
        rows.append(Row("memcpy", "copy", size, 1, 1, moved / sum(passes) / 1e9,
                        _percentile(per_copy, 50) * 1e6, _percentile(per_copy, 99) * 1e6,
                        statistics.fmean(per_copy) * 1e6, len(passes) * len(pieces)))
    return rows


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> list[Row]:
    """Start the target process (and the raw socket server with ``raw_rounds``), measure
    memcpy and every cell, stop them."""
    proc, remote = start_target(cfg.segment_bytes())
    rows: list[Row] = []
    raw = RawServer(cfg.segment_bytes(), cfg.socket_buffer) \
        if cfg.raw_rounds and "tcp" in cfg.transports else None
    try:
        local = np.ones(cfg.segment_bytes(), np.uint8)
        if cfg.memcpy:
            if progress is not None:
                progress("memcpy reference")
            rows += measure_memcpy(sorted(set(cfg.sizes)), cfg.duration_s,
                                   min(cfg.segment_bytes(), 256 << 20))
        for cell in cfg.cells():
            if progress is not None:
                progress(f"{cell[0]} {cell[1]} size={cell[2]} batch={cell[3]} lanes={cell[4]}")
            try:
                row = measure_cell(remote, *cell, cfg=cfg, local=local,
                                   pair_memcpy=cell[0] == "shm" and cfg.memcpy,
                                   target_pid=proc.pid,
                                   raw_port=raw.port if raw and cell[0] == "tcp" else 0)
            except TransferError as e:  # keep the other cells; the row says what went wrong
                log.warning("bench cell %s failed: %s", cell, e)
                row = Row(*cell, gbps=0.0, p50_us=0.0, p99_us=0.0, extra={"error": str(e)})
            rows.append(row)
    finally:
        stop_target(proc)
        if raw is not None:
            raw.close()
    return rows


if __name__ == "__main__":
    serve(int(sys.argv[1]))
