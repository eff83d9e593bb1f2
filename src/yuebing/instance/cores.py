"""`CoreLedger`: the instances of one host lend each other their idle cores (``--lend-cores``).

Each instance's `EngineDriver` (a vLLM worker's `integrations.vllm.lend.StepThreads`, opt-in)
holds a slot in a host-wide ledger (a small shared-memory file,
``/dev/shm/yuebing-cores-v4-<uid>``): its own threads, its *claim* (its own threads while it
has work, 0 when idle), the threads it *uses* during a step (0 between steps) and whether it is
*critical* (a decode or coupled instance: its steps are token intervals). Before each step
`acquire` claims its own threads and waits until the others' steps leave room for them; a
non-critical (prefill) step also keeps out of the claims of critical slots between steps and
takes its turn after the non-critical steps waiting longer. A step runs with its own threads
plus every core nobody claims; `release` after it. Waits end after `WAIT_MAX_S` (a stuck peer).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

SLOTS = 64
LAYOUT = 4
"""Part of the ledger's file name: another slot layout is another file."""
_SLOT = struct.Struct("<qiiiiqq")
"""pid (0 = free), own threads, claim, threads in use, critical (1 or 0), when its wait for a
step began (a non-critical slot's turn: CLOCK_MONOTONIC ns, 0 = not waiting), the process's
start time (clock ticks since boot: a recycled pid is not the instance that wrote the slot)."""
WAIT_POLL_S = 0.0005
WAIT_POLL_MAX_S = 0.004
"""A non-critical wait polls ever more slowly, up to this: it waits for another prefill's
chunk, and its polling must not take the cores it waits for."""
WAIT_MAX_S = 2.0
"""The longest a step waits (a stuck peer must not stall it): then it runs anyway."""


def host_cores() -> int:
    """The cores the host's instances share: the calling thread's affinity."""
    return len(os.sched_getaffinity(0))


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


@dataclass(frozen=True)
class Others:
    """The other live slots of the ledger, as one step's `acquire` sees them."""

    using: int = 0
    """Threads their steps use now."""
    taken: int = 0
    """Cores they claim or use (a step borrows only the rest)."""
    critical: int = 0
    """Cores the critical slots claim or use (their reservation)."""
    plain_using: int = 0
    """Threads the non-critical slots' steps use now."""
    ahead: bool = False
    """A non-critical slot has waited longer than this one's wait began."""

    def room(self, threads: int, cores: int) -> bool:
        """Whether a critical step of ``threads`` fits beside the steps running."""
        return self.using + threads <= cores

    def turn(self, threads: int, cores: int) -> bool:
        """Whether a non-critical step of ``threads`` may start: no non-critical wait is
        older, and it fits beside the steps running and the critical slots' claims, those
        counted up to the cores it leaves free (so it still runs, one at a time, when
        critical claims fill the host)."""
        reserved = min(self.critical, max(0, cores - threads))
        return not self.ahead and self.room(threads, cores) and \
            self.plain_using + reserved + threads <= cores


class CoreLedger:
    """This process's slot in the host's ledger; see the module docstring. ``critical``: a
    latency-critical instance (decode, coupled), whose claim non-critical steps keep out of."""

    def __init__(self, threads: int, path: Path | None = None, cores: int = 0,
                 critical: bool = False) -> None:
        self.threads = threads
        self.critical = critical
        self.cores = cores or host_cores()
        """The host's cores the steps share (default: `host_cores`)."""
        self.path = path or ledger_path()
        self._start = _started(os.getpid())
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        """Open while the slot is: its lock orders non-critical steps' starts."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if os.fstat(self._fd).st_size < SLOTS * _SLOT.size:
                    os.ftruncate(self._fd, SLOTS * _SLOT.size)
                self._map = mmap.mmap(self._fd, SLOTS * _SLOT.size)
                self.slot = self._claim()
                self._write(0, 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(self._fd)
            raise

    def _claim(self) -> int:
        for i in range(SLOTS):
            pid, *_, started = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid == 0 or not _alive(pid, started):
                return i
        raise RuntimeError(f"the core ledger {self.path} has no free slot ({SLOTS} instances "
                           "on this host)")

    def _write(self, claim: int, using: int, waiting: int = 0) -> None:
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, os.getpid(), self.threads, claim,
                        using, int(self.critical), waiting, self._start)

    def others(self, waiting: int = 0) -> Others:
        """The other live slots; ``waiting``: when this slot's wait began (who is ahead)."""
        using = taken = critical = plain = 0
        ahead = False
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, _, claim, used, crit, since, started = _SLOT.unpack_from(
                self._map, i * _SLOT.size)
            if not (pid and (claim or used) and _alive(pid, started)):
                continue
            using += used
            taken += max(claim, used)
            if crit:
                critical += max(claim, used)
            else:
                plain += used
                ahead = ahead or (since > 0 and waiting > 0 and
                                  (since, i) < (waiting, self.slot))
        return Others(using, taken, critical, plain, ahead)

    def acquire(self, borrow: bool = True) -> int:
        """Before a step: claim our threads, wait (at most `WAIT_MAX_S`) for room — a
        critical step until the others' steps leave room for it, a non-critical one also for
        its turn (`Others.turn`) — and return the threads to step with: ours, plus every core
        no one claims when ``borrow``."""
        deadline = time.monotonic() + WAIT_MAX_S
        if self.critical:
            self._write(self.threads, 0)
            while not self.others().room(self.threads, self.cores) and \
                    time.monotonic() < deadline:
                time.sleep(WAIT_POLL_S)
            n = self._threads(self.others(), borrow)
            self._write(self.threads, n)
            return n
        since = time.monotonic_ns()
        self._write(self.threads, 0, since)
        poll = WAIT_POLL_S
        try:
            while True:
                fcntl.flock(self._fd, fcntl.LOCK_EX)  # one non-critical start at a time
                try:
                    others = self.others(since)
                    if others.turn(self.threads, self.cores) or time.monotonic() >= deadline:
                        n = self._threads(others, borrow)
                        self._write(self.threads, n)
                        return n
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                time.sleep(poll)
                poll = min(2 * poll, WAIT_POLL_MAX_S)
        except BaseException:
            self._write(self.threads, 0)  # no longer waiting
            raise

    def threads_now(self) -> int:
        """The threads a step begun now would run with (for load reports; no wait)."""
        return self._threads(self.others(), True)

    def _threads(self, others: Others, borrow: bool) -> int:
        return max(self.threads, self.cores - others.taken) if borrow else self.threads

    def release(self, idle: bool) -> None:
        """After a step: the threads are free again; ``idle``: no claim until the next step."""
        self._write(0 if idle else self.threads, 0)

    def close(self) -> None:
        """Give the slot back (a killed process's slot is reclaimed by the next to register)."""
        with contextlib.suppress(ValueError):
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0, 0, 0, 0, 0)
            self._map.close()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
