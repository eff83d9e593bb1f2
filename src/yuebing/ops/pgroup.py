"""A process group read from ``/proc``: its processes (`group_pids`), whether one still runs
(`group_alive`: a zombie, exited but not reaped, does not), the CPU time its processes have
used (`group_cpu_seconds`) and a SIGKILL that waits until none runs (`kill_group`). Called by
`ops.shm` (whose files a killed group held), by `cluster.process` (a role's group) and
`integrations.vllm.server` (a server's), and by ``benchmarks/engine_peers.py`` (stopping and
metering a peer started in its own session). Linux only; without ``/proc`` a group has no
processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` used here (the name, which may hold spaces and ``)``,
    is skipped: fields are counted after its last ``)``)."""

    state: str
    pgid: int
    cpu_ticks: int
    """utime + stime: every thread of the process, those ended included."""

    @classmethod
    def parse(cls, raw: bytes) -> ProcStat:
        try:
            fields = raw[raw.rindex(b")") + 2:].split()
            return cls(fields[0].decode(), int(fields[2]), int(fields[11]) + int(fields[12]))
        except (ValueError, IndexError) as e:
            raise ValueError(f"not a /proc/<pid>/stat line: {raw[:120]!r}") from e


def proc_stat(pid: int, proc_dir: Path = PROC) -> ProcStat | None:
    """``pid``'s stat, or None once it is gone (reaped)."""
    try:
        return ProcStat.parse((proc_dir / str(pid) / "stat").read_bytes())
    except OSError:
        return None


def pids(proc_dir: Path = PROC) -> list[int]:
    """Every process id on the host (none without ``proc_dir``)."""
    try:
        return [int(p.name) for p in proc_dir.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def group_stats(pgid: int, proc_dir: Path = PROC) -> dict[int, ProcStat]:
    """The stat of each process (zombies included) whose process group is ``pgid``."""
    out = {}
    for pid in pids(proc_dir):
        st = proc_stat(pid, proc_dir)
        if st is not None and st.pgid == pgid:
            out[pid] = st
    return out


def group_pids(pgid: int, proc_dir: Path = PROC) -> list[int]:
    """The processes of group ``pgid``, zombies included (they may still hold a file open only
    until they exit; `group_alive` is the test for "still runs")."""
    return sorted(group_stats(pgid, proc_dir))


def group_alive(pgid: int, proc_dir: Path = PROC) -> bool:
    """Whether a process of group ``pgid`` still runs: one that is not a zombie (exited, not yet
    reaped by its parent; it holds no memory and runs no code)."""
    return any(st.state != "Z" for st in group_stats(pgid, proc_dir).values())


def group_cpu_seconds(pgid: int, proc_dir: Path = PROC) -> float:
    """User + system CPU seconds of the processes of group ``pgid`` that are still listed (a
    process's own total covers its ended threads too; a reaped process drops out)."""
    ticks = sum(st.cpu_ticks for st in group_stats(pgid, proc_dir).values())
    return ticks / os.sysconf("SC_CLK_TCK")


def kill_group(pgid: int, wait_s: float = 5.0, proc_dir: Path = PROC) -> bool:
    """SIGKILL group ``pgid`` and wait up to ``wait_s`` until none of its processes runs (a
    signalled process exits only once scheduled). Whether the group is gone; a warning names
    what still runs. A group with no process listed is not signalled (its id may be reused)."""
    if pgid <= 1:
        raise ValueError(f"process group {pgid} is not a child's group")
    if not group_stats(pgid, proc_dir):
        return True
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    if wait_group(pgid, wait_s, proc_dir=proc_dir):
        return True
    log.warning("process group %d still runs %.1f s after SIGKILL: %s", pgid, wait_s,
                group_pids(pgid, proc_dir))
    return False


def wait_group(pgid: int, wait_s: float, poll_s: float = 0.02, proc_dir: Path = PROC) -> bool:
    """Wait up to ``wait_s`` until no process of group ``pgid`` runs (`group_alive`, checked
    every ``poll_s``: each check scans ``proc_dir``); whether none does."""
    end = time.monotonic() + wait_s
    while group_alive(pgid, proc_dir):
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)
    return True
