"""Shared-memory files a process group holds, and the sweep of those nobody holds any more.

A process killed with SIGKILL never unlinks its POSIX shared memory: vLLM's message queues
(``/dev/shm/psm_*``, ~200 MB per server) and semaphores (``sem.mp-*``) then stay until reboot.
`VllmServer` (`yuebing.integrations.vllm.server`) notes the files its server's process group
maps or has open (`group_files`) once it is ready and again when it stops it, and afterwards
removes those no living process holds (`sweep`). Files are matched by inode: a semaphore's
creator maps it under a temporary name (glibc links ``sem.XXXXXX`` to ``sem.mp-*``, then unlinks
it). Only the files seen held by that group, still under the names seen, are candidates, so
another program's files are never touched. Linux only (``/proc``); elsewhere a no-op.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from yuebing.ops.pgroup import PROC, group_pids, pids


def _held(pid: int, where: Path) -> set[int]:
    """The inodes of the files under ``where`` that ``pid`` maps or has open, those unlinked
    since included (a map or descriptor keeps the inode). By inode alone: ``where`` is one
    directory (of one file system), and an overlay file system reports another device in
    ``maps`` than `os.stat` does."""
    found: set[int] = set()
    prefix = str(where) + "/"
    with contextlib.suppress(OSError):
        for line in (PROC / str(pid) / "maps").read_text(errors="replace").splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix):
                with contextlib.suppress(ValueError):
                    found.add(int(parts[4]))
    with contextlib.suppress(OSError):
        for fd in (PROC / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith(prefix):
                    found.add(os.stat(fd).st_ino)
    return found


def _inode(path: Path) -> int | None:
    """``path``'s inode, None once it is gone."""
    try:
        return path.stat(follow_symlinks=False).st_ino
    except OSError:
        return None


PYTHON_SHM = ("psm_", "sem.mp-")
"""Python's `multiprocessing.shared_memory` segments and its named semaphores."""


def group_files(pgid: int, where: Path = Path("/dev/shm"),
                prefixes: tuple[str, ...] = PYTHON_SHM) -> dict[Path, int]:
    """The files ``where/<prefix>*`` that the processes of group ``pgid`` map or have open,
    each with its inode then (what `sweep` checks, so a name reused later is not taken)."""
    held: set[int] = set()
    for pid in group_pids(pgid):
        held |= _held(pid, where)
    if not held:
        return {}
    try:
        names = [where / n for n in os.listdir(where) if n.startswith(prefixes)]
    except OSError:
        return {}
    return {f: i for f in names if (i := _inode(f)) in held}


def sweep(candidates: Mapping[Path, int] | Iterable[Path]) -> list[Path]:
    """Unlink the ``candidates`` that no living process maps or has open; returns those
    removed. Given with the inodes seen held (`group_files`), only a name that still is that
    file; given as paths, whatever file each names now."""
    if isinstance(candidates, Mapping):
        left = {c: i for c, i in candidates.items() if _inode(c) == i}
    else:
        left = {c: i for c in candidates if (i := _inode(c)) is not None}
    if not left:
        return []
    dirs = {c.parent for c in left}
    for pid in pids():
        for d in dirs:
            held = _held(pid, d)
            left = {c: i for c, i in left.items() if i not in held}
        if not left:
            return []
    removed = []
    for c, i in sorted(left.items()):
        if _inode(c) == i:  # not replaced by another file of that name meanwhile
            with contextlib.suppress(FileNotFoundError):
                c.unlink()
                removed.append(c)
    return removed
