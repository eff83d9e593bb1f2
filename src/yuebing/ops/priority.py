"""Engine processes at a lower CPU priority, so the control plane wins a core when it wakes.

`EnginePriority` (``--engine-nice``, ``--engine-idle``) is applied by the engine's own process at
its start (`apply_self`: yuebing's instances, `instance.run`) or between fork and exec of a
child (`apply_child`: the vLLM server a ``yuebing vllm instance`` starts). It adds to the nice of
every thread and, where the process leads its own session, of its autogroup: with
``kernel.sched_autogroup_enabled`` 1 each session is one group and nice ranks threads only
inside a group. Raising either needs no privilege; the Conductor and the store keep theirs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from yuebing.core.config import require

log = logging.getLogger(__name__)

MAX_NICE = 19
AUTOGROUP_RETRY_S = 5.0
"""The kernel lets an unprivileged process set an autogroup's nice once per 100 ms host-wide
(EAGAIN between): several engines starting together retry this long (tens of them fit)."""
NICE_HELP = ("added to the engine's nice and, where it leads its session, its autogroup's (max "
             "19), so the Conductor and the store master win a core when they wake: on a host "
             "whose engines fill every core their requests wait for one otherwise (dispatch "
             "p99, docs/serving.md); 0 = the engine at the priority of what started it")
IDLE_HELP = ("also run the engine SCHED_IDLE (below nice 19: for a supervisor itself at nice 19, "
             "or a host that runs nothing else; any busy process then starves it)")


@dataclass(frozen=True)
class EnginePriority:
    """How much lower than its parent an engine process runs: ``nice`` added to its threads'
    and its autogroup's nice (capped at 19; 0 = unchanged) and, with ``idle``, the
    ``SCHED_IDLE`` policy (runs only on a core nothing else wants: below even nice 19)."""

    nice: int = 10
    idle: bool = False

    def __post_init__(self) -> None:
        require(0 <= self.nice <= MAX_NICE,
                f"--engine-nice must be in 0..{MAX_NICE} (0 = the engine at the priority of "
                f"its parent), got {self.nice}")

    @property
    def off(self) -> bool:
        return self.nice == 0 and not self.idle

    def apply_self(self) -> str:
        """Lower every thread of this process (threads started later inherit it) and, if it
        leads its session, its autogroup. Returns what it did, for a log line; an OS that
        refuses a step is logged, never fatal."""
        if self.off:
            return "engine priority unchanged (--engine-nice 0)"
        tids = [int(t) for t in os.listdir("/proc/self/task")] if Path(
            "/proc/self/task").is_dir() else [0]
        for tid in tids:
            try:
                self._thread(tid)
            except ProcessLookupError:  # a thread that just ended
                pass
            except OSError as e:
                log.warning("engine priority: thread %d left as it is (%s)", tid, e)
        try:
            group = self._autogroup()
        except OSError as e:
            group = f"left as it is ({e})"
            log.warning("engine priority: autogroup %s", group)
        return (f"engine priority: nice {os.getpriority(os.PRIO_PROCESS, 0)}"
                f"{', SCHED_IDLE' if self.idle else ''}, autogroup {group}")

    def apply_child(self) -> None:
        """For ``preexec_fn`` (one thread, after ``setsid``): the same as `apply_self`,
        silently (no logging between fork and exec)."""
        if self.off:
            return
        with contextlib.suppress(OSError):
            self._thread(0)
        with contextlib.suppress(OSError):
            self._autogroup()

    def _thread(self, tid: int) -> None:
        if self.nice:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + self.nice))
        if self.idle:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))

    def _autogroup(self) -> str:
        """Raise the autogroup's nice when this process leads its session (its group is its
        own: otherwise it is its terminal's, which this must not lower). Returns its state."""
        path = Path("/proc/self/autogroup")
        if not path.exists():
            return "none (kernel without autogroups)"
        if os.getsid(0) != os.getpid():
            return "shared with the session's other processes, left as it is"
        shown = path.read_text().split()  # empty in the root group (no autogroup of its own)
        if not shown:
            return "none (the process is in the root task group)"
        now = int(shown[-1])
        want = min(MAX_NICE, now + ((self.nice or MAX_NICE) if self.idle else self.nice))
        end = time.monotonic() + AUTOGROUP_RETRY_S
        while True:
            try:
                path.write_text(str(want))
                return f"nice {want}"
            except OSError as e:
                if e.errno != errno.EAGAIN or time.monotonic() > end:
                    raise
                time.sleep(random.uniform(0.01, 0.05))  # siblings spread their tries
