"""Shared-memory files a process group holds, and the sweep of those nobody holds any more.

A process killed with SIGKILL never unlinks its POSIX shared memory: vLLM's message queues
(``/dev/shm/psm_*``, ~200 MB per server) and semaphores (``sem.mp-*``) then stay until reboot. `VllmServer`
(`yuebing.integrations.vllm.server`) notes the files its server's process group maps or has
open (`group_files`) once it is ready and again when it stops it, and afterwards removes
those no living process holds (`sweep`). Only files seen held by that group are candidates,
so another program's segments are never touched. Linux only (``/proc``); elsewhere a no-op.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from yuebing.ops.pgroup import PROC, group_pids, pids


def _held(pid: int, where: Path) -> set[Path]:
    """Files under ``where`` that ``pid`` maps or has open."""
    found: set[Path] = set()
    prefix = str(where) + "/"
    with contextlib.suppress(OSError):
        for line in (PROC / str(pid) / "maps").read_text(errors="replace").splitlines():
            parts = line.split(maxsplit=5)
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith(prefix):
                found.add(Path(path.removesuffix(" (deleted)")))
    with contextlib.suppress(OSError):
        for fd in (PROC / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith(prefix):
                    found.add(Path(target.removesuffix(" (deleted)")))
    return found


PYTHON_SHM = ("psm_", "sem.mp-")
"""Python's `multiprocessing.shared_memory` segments and its named semaphores."""


def group_files(pgid: int, where: Path = Path("/dev/shm"),
                prefixes: tuple[str, ...] = PYTHON_SHM) -> set[Path]:
    """The files ``where/<prefix>*`` that the processes of group ``pgid`` map or have open."""
    out: set[Path] = set()
    for pid in group_pids(pgid):
        out |= {f for f in _held(pid, where) if f.name.startswith(prefixes)}
    return out


def sweep(candidates: Iterable[Path]) -> list[Path]:
    """Unlink the ``candidates`` that still exist and no living process maps or has open;
    returns those removed."""
    left = {c for c in candidates if c.exists()}
    if not left:
        return []
    dirs = {c.parent for c in left}
    for pid in pids():
        for d in dirs:
            left -= _held(pid, d)
        if not left:
            return []
    removed = []
    for c in sorted(left):
        with contextlib.suppress(FileNotFoundError):
            c.unlink()
            removed.append(c)
    return removed
