"""`CoreLedger`: the instances of one host lend each other their idle cores.

On a small host (`yuebing serve` on 2 cores: a prefill and a decode instance, one thread each)
one instance often idles while the other works: in prefix-heavy chat the prefill takes
milliseconds and the decode then steps for seconds. Each instance's `EngineDriver` holds a slot
in a host-wide ledger (a small shared-memory file, ``/dev/shm/yuebing-cores-v2-<uid>``) with its
own thread count and whether it is stepping. Before each step it takes its own threads plus those
of every live instance of the ledger that is idle, up to the cores this process may use. A lender
that gets work marks itself busy at once and steps with its own threads; the borrower gives them
back at its next step, so the two overlap by at most one step.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
from pathlib import Path

log = logging.getLogger(__name__)

SLOTS = 64
LAYOUT = 2
"""Part of the ledger's file name: another slot layout is another file."""
_SLOT = struct.Struct("<qiiq")
"""pid (0 = free), threads, busy, the process's start time (clock ticks since boot: a recycled
pid is not the instance that wrote the slot)."""


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

    def __init__(self, threads: int, path: Path | None = None) -> None:
        self.threads = threads
        self.cores = len(os.sched_getaffinity(0))
        self.path = path or ledger_path()
        self._start = _started(os.getpid())
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < SLOTS * _SLOT.size:
                os.ftruncate(fd, SLOTS * _SLOT.size)
            self._map = mmap.mmap(fd, SLOTS * _SLOT.size)
            self.slot = self._claim()
            self._write(busy=False)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._busy = False

    def _claim(self) -> int:
        for i in range(SLOTS):
            pid, _, _, started = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid == 0 or not _alive(pid, started):
                return i
        raise RuntimeError(f"the core ledger {self.path} has no free slot ({SLOTS} instances "
                           "on this host)")

    def _write(self, busy: bool) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, os.getpid(), self.threads, int(busy),
                        self._start)

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            self._write(busy)

    def threads_now(self) -> int:
        """Own threads plus the idle live instances' ones, at most this process's cores."""
        total = self.threads
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, threads, busy, started = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid and not busy and pid != os.getpid() and _alive(pid, started):
                total += threads
        return max(1, min(total, self.cores))

    def close(self) -> None:
        """Give the slot back (a killed process's slot is reclaimed by the next to register)."""
        with contextlib.suppress(ValueError):
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0, 0)
            self._map.close()
