"""The TCP lane count of this machine (`TransferConfig.lanes` = -1, the default): measured once
per machine and kept (`core.choices`); `TransferEngine` calls `resolve_lanes` at start-up.

Each lane costs a sender and a receiver thread on both ends: more lanes overlap more copies and
system calls where there are cores for them and only add hand-offs where there are not (on a
2-core VM, 2 lanes read ~7 % faster than 4). `measure_lanes` times the candidates against the
benchmark's target child process over loopback (``python -m yuebing.transfer.bench BYTES``),
interleaved in rounds, write and read of a batch of 1 MiB requests; more lanes must win by
`MARGIN`.
Loopback prices this machine's CPU per lane; a network whose one flow is slower than the
copies wants more lanes: give ``--lanes``.
"""

from __future__ import annotations

import logging
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from yuebing.core import env
from yuebing.core.choices import machine_parts, shared_choice
from yuebing.core.errors import InputError, TransferError
from yuebing.core.spin import AUTO
from yuebing.transfer.config import TransferConfig
from yuebing.transfer.types import BatchStatus, OpCode, TransferRequest, TransferStatus

log = logging.getLogger(__name__)

CANDIDATES = (1, 2, 4, 8)
REQUEST = 1 << 20
BATCH = 8
ROUNDS = 7
MARGIN = 0.05
"""More lanes are chosen only when their median batch time is this much shorter."""
FALLBACK = 4
"""Lanes where the measurement fails (logged; measured again by the next process)."""
VERSION = 1
"""Bump when the measurement changes: every machine measures again."""
TARGET_READY_S = 60.0


class Initiator(Protocol):
    """What the measurement needs of a `TransferEngine` (passed in: the engine calls this
    module)."""

    def transfer_status(self, requests: list[TransferRequest], timeout_s: float | None = None,
                        inline: bool = False) -> BatchStatus: ...

    def close(self) -> None: ...


class MeasureFailed(Exception):
    """The measurement could not run (no target process, a failed transfer): nothing is kept."""


def candidates(cpus: int) -> tuple[int, ...]:
    """Lane counts worth timing on ``cpus`` CPUs: up to two lanes per CPU (a lane's two
    threads mostly wait), at least 1 and 2."""
    return tuple(n for n in CANDIDATES if n <= max(2, 2 * cpus))


def resolve_lanes(cfg: TransferConfig, make: Callable[[TransferConfig], Initiator],
                  root: Any = None) -> tuple[TransferConfig, str]:
    """``cfg`` with its lane count settled, and how it was: "configured" (``--lanes N``),
    "not used" (no TCP), "kept for this machine", "measured now" or "fallback" (the
    measurement failed: `FALLBACK`, measured again next time). ``make`` builds an initiator
    engine of a config (`TransferEngine`)."""
    if cfg.lanes != AUTO:
        return cfg, "configured"
    if "tcp" not in cfg.transports:
        return replace(cfg, lanes=FALLBACK), "not used"
    here = machine_parts()
    cands = candidates(int(here["cpus"]))  # type: ignore[call-overload]
    parts = {"kind": "transfer.lanes", "version": VERSION, **here, "candidates": cands,
             "slice_size": cfg.slice_size, "socket_buffer": cfg.socket_buffer}
    try:
        (lanes, timings), kept = shared_choice(
            parts, lambda: measure_lanes(cfg, make, cands), lanes_choice, root)
    except MeasureFailed as e:
        log.warning("TCP lanes: measuring failed (%s); using %d", e, FALLBACK)
        return replace(cfg, lanes=FALLBACK), "fallback"
    log.debug("TCP lane timings (ms per batch): %s", timings)
    return replace(cfg, lanes=lanes), "kept for this machine" if kept else "measured now"


def lanes_choice(raw: Any) -> tuple[int, dict[str, float]]:
    """`measure_lanes`'s (lanes, timings) from JSON."""
    lanes, timings = raw
    if not (isinstance(lanes, int) and 1 <= lanes <= 64 and isinstance(timings, dict)):
        raise TypeError(f"not a lane choice: {raw!r}")
    return lanes, {str(k): float(v) for k, v in timings.items()}


def pick(timings: dict[int, float], margin: float = MARGIN) -> int:
    """The fewest lanes whose batch time no more-lane count beats by ``margin``."""
    best = min(timings)
    for n in sorted(timings):
        if timings[n] < timings[best] * (1 - margin):
            best = n
    return best


def measure_lanes(cfg: TransferConfig, make: Callable[[TransferConfig], Initiator],
                  cands: tuple[int, ...]) -> tuple[int, dict[str, float]]:
    """Time a write and a read batch (`BATCH` × `REQUEST`) per candidate lane count against a
    target child, `ROUNDS` interleaved rounds; (`pick` of the medians, ms per candidate)."""
    proc, remote = start_target(BATCH * REQUEST, streaming=False)
    engines: dict[int, Initiator] = {}
    try:
        local = np.ones(BATCH * REQUEST, np.uint8)
        reqs = {op: [TransferRequest(op, local[i * REQUEST:(i + 1) * REQUEST], remote,
                                     i * REQUEST) for i in range(BATCH)]
                for op in (OpCode.WRITE, OpCode.READ)}
        for n in cands:
            engines[n] = make(replace(cfg, lanes=n, transports=("tcp",), metadata="p2p",
                                      host="127.0.0.1", port=0, advertise_host="",
                                      engine_id=""))  # never the caller's port or name
            _round(engines[n], reqs)  # connect and warm the lanes
        took: dict[int, list[float]] = {n: [] for n in cands}
        for r in range(ROUNDS):
            for n in cands[r % len(cands):] + cands[:r % len(cands)]:
                took[n].append(_round(engines[n], reqs))
    except (OSError, TransferError, InputError) as e:
        raise MeasureFailed(str(e)) from e
    finally:
        for eng in engines.values():
            eng.close()
        stop_target(proc)
    medians = {n: statistics.median(t) for n, t in took.items()}
    return pick(medians), {str(n): round(t * 1e3, 3) for n, t in medians.items()}


def _round(engine: Initiator, reqs: dict[OpCode, list[TransferRequest]]) -> float:
    t0 = time.perf_counter()
    for batch in reqs.values():
        st = engine.transfer_status(batch, inline=False)
        if st.status != TransferStatus.DONE:
            raise MeasureFailed("; ".join(st.errors) or "a lane transfer failed")
    return time.perf_counter() - t0


def start_target(segment_bytes: int, streaming: bool = True) -> tuple[subprocess.Popen[str], str]:
    """The benchmark's target process (`transfer.bench.serve`) and its P2P segment name.
    ``streaming=False`` gives it plain copies: it then never asks for the small-copy choice,
    whose lock a lane measurement holds while it waits for this process; and it takes kept
    choices as they are (`core.choices`: a provisional one is measured again under that lock)."""
    extra = {env.KEEP_CHOICES: "1", **({} if streaming else {env.STREAM_COPY: "0"})}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "yuebing.transfer.bench",
                                 str(segment_bytes)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env.child_env(extra))
    except OSError as e:
        raise MeasureFailed(f"cannot start the target process: {e}") from e
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], TARGET_READY_S)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        stop_target(proc)
        raise MeasureFailed(f"the target process did not serve within {TARGET_READY_S} s")
    return proc, line


def stop_target(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
