"""`CoreLedger`: the instances of one host lend each other their idle cores (``--lend-cores``).

Each instance's `EngineDriver` (a vLLM worker's `integrations.vllm.lend.StepThreads`, opt-in)
holds a slot in a host-wide ledger (a small shared-memory file,
``/dev/shm/yuebing-cores-v3-<uid>``): its own threads, its *claim* (its own threads while it
has work, 0 when idle) and the threads it *uses* during a step (0 between steps). Before each
step `acquire` claims its own threads, waits until the others' steps leave room for them and
steps with its own threads plus every core nobody claims; `release` after the step. A lender
that gets work so waits for the borrower's current step to end (at most `WAIT_MAX_S`), so
steps keep within the host's cores (OpenMP threads spin at every barrier).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from pathlib import Path

SLOTS = 64
LAYOUT = 3
"""Part of the ledger's file name: another slot layout is another file."""
_SLOT = struct.Struct("<qiiiq")
"""pid (0 = free), own threads, claim, threads in use, the process's start time (clock ticks
since boot: a recycled pid is not the instance that wrote the slot)."""
WAIT_POLL_S = 0.0005
WAIT_MAX_S = 2.0
"""The longest a claimer waits for a borrower's step (a stuck peer must not stall it)."""


def ledger_path() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"yuebing-cores-v{LAYOUT}-{os.getuid()}"


def _started(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (/proc/PID/stat field 22), 0 if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _alive(pid: int, started: int) -> bool:
    return pid > 0 and _started(pid) == started


class CoreLedger:
    """This process's slot in the host's ledger; see the module docstring."""

    def __init__(self, threads: int, path: Path | None = None, cores: int = 0) -> None:
        self.threads = threads
        self.cores = cores or len(os.sched_getaffinity(0))
        """The host's cores the steps share (default: the calling thread's affinity)."""
        self.path = path or ledger_path()
        self._start = _started(os.getpid())
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < SLOTS * _SLOT.size:
                os.ftruncate(fd, SLOTS * _SLOT.size)
            self._map = mmap.mmap(fd, SLOTS * _SLOT.size)
            self.slot = self._claim()
            self._write(0, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _claim(self) -> int:
        for i in range(SLOTS):
            pid, _, _, _, started = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid == 0 or not _alive(pid, started):
                return i
        raise RuntimeError(f"the core ledger {self.path} has no free slot ({SLOTS} instances "
                           "on this host)")

    def _write(self, claim: int, using: int) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, os.getpid(), self.threads, claim,
                        using, self._start)

    def _others(self) -> tuple[int, int]:
        """(threads the live others use now, cores they claim or use) over the ledger."""
        using = taken = 0
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, _, claim, used, started = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid and (claim or used) and _alive(pid, started):
                using += used
                taken += max(claim, used)
        return using, taken

    def acquire(self, borrow: bool = True) -> int:
        """Before a step: claim our threads, wait (at most `WAIT_MAX_S`) until the others'
        steps leave room for them, and return the threads to step with — ours, plus every core
        no one claims when ``borrow``."""
        self._write(self.threads, 0)
        deadline = time.monotonic() + WAIT_MAX_S
        while self._others()[0] + self.threads > self.cores and time.monotonic() < deadline:
            time.sleep(WAIT_POLL_S)
        n = max(self.threads, self.cores - self._others()[1]) if borrow else self.threads
        self._write(self.threads, n)
        return n

    def release(self, idle: bool) -> None:
        """After a step: the threads are free again; ``idle``: no claim until the next step."""
        self._write(0 if idle else self.threads, 0)

    def close(self) -> None:
        """Give the slot back (a killed process's slot is reclaimed by the next to register)."""
        with contextlib.suppress(ValueError):
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0, 0, 0)
            self._map.close()
