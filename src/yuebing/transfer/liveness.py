"""Liveness of shared-memory segment files: whoever owns a segment holds a lock on its file.

The owner (`create_owned_file`, via `segment.create_shm_segment`) takes an exclusive ``flock``
before the file appears under its final name and holds it until it unregisters the segment or
dies (``kill -9`` too). Everyone else takes only *shared* locks, so they contend only with a
live owner: a peer that maps the file (`MappedFile`: shm copy threads, the store's same-host
path) probes `MappedFile.owner_alive` around its copies; `sweep_dead_segments` (engine start, a
shm peer's death, store nodes, the ``yuebing serve`` supervisor) unlinks unowned files. A
``fork`` without ``exec`` shares the parent's lock; ``exec``ed children do not inherit it.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import weakref

import numpy as np

from yuebing.core.errors import TransferError

log = logging.getLogger(__name__)

SHM_PREFIX = "yuebing-tx-"
"""Name prefix of every segment file an engine creates in its ``shm_dir``."""

DEFAULT_SHM_DIR = "/dev/shm"

_counter = itertools.count()


def create_owned_file(shm_dir: str, size: int) -> tuple[str, int]:
    """Create a new ``size``-byte segment file in ``shm_dir`` and lock it as its owner; returns
    (path, fd) — the fd holds the lock: close it only after unlinking the file. A sweeper that
    found the file in the instant before the lock was taken makes this try another name, so a
    file under the prefix is never unlocked while its owner lives."""
    for _ in range(8):
        path = os.path.join(shm_dir, f"{SHM_PREFIX}{os.getpid()}-{next(_counter)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a sweeper holds it for a moment; it will unlink it
            os.close(fd)
            continue
        if not _same_file(path, fd):  # a sweeper unlinked it before we locked it
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.unlink(path)
            os.close(fd)
            raise
        return path, fd
    raise TransferError(f"could not create a segment file in {shm_dir} (swept away 8 times)")


def _same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def owner_alive(fd: int) -> bool:
    """Whether the owner of the segment file open as ``fd`` still holds its lock: a shared
    lock is refused only while an owner's exclusive one is held (two syscalls, ~1 µs)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def sweep_dead_segments(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Unlink every segment file in ``shm_dir`` (this user's, named with `SHM_PREFIX`) that no
    owner holds any more — its engine died (``kill -9`` too) without unregistering it — and
    return their paths. A live owner's file is never removed: its exclusive lock refuses the
    shared lock this takes before unlinking (and a file being created is locked before it is
    checked); a file whose creator (the pid in its name) still runs is kept as well, so the
    unlocked files of a live engine of an older version survive (a reused pid only delays a
    removal). Safe to call from any process at any time: every engine when it starts and when
    its shm transport sees a peer die, every store node periodically, the `yuebing serve`
    supervisor when a child dies. Peers that still map a swept file keep its memory until
    they unmap it."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(shm_dir))
    except OSError as e:
        log.warning("cannot list %s to sweep dead segments: %s", shm_dir, e)
        return removed
    uid = os.getuid()
    for entry in entries:
        pid = _creator(entry.name)
        if pid is None or _pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_uid == uid and _sweep_one(entry.path):
                removed.append(entry.path)
    if removed:
        log.info("swept %d dead segment files from %s", len(removed), shm_dir)
    return removed


def _creator(name: str) -> int | None:
    """The pid in a segment file's name (``yuebing-tx-PID-N``), None for other names."""
    if not name.startswith(SHM_PREFIX):
        return None
    pid, _, n = name[len(SHM_PREFIX):].partition("-")
    return int(pid) if pid.isdigit() and n.isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_one(path: str) -> bool:
    """Unlink ``path`` if no owner holds it (checked under a shared lock, and that the name
    still refers to the file locked); True if it was removed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives
        if not _same_file(path, fd):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


class MappedFile:
    """A peer's segment file mapped read-write into this process (``arr``: uint8 numpy view,
    ``mv``: memoryview, same bytes), with its fd kept open to probe the owner's lock.
    Used by the shm transport (which drops its references and lets the garbage collector
    unmap and close, as copy threads may still hold one) and the store's same-host direct
    path (which calls `close`)."""

    __slots__ = ("__weakref__", "_closer", "arr", "fd", "mm", "mv", "path", "size")

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(self.fd).st_size < size:
                raise TransferError(f"shared memory file {path} is smaller than its descriptor says "
                                    f"({size} bytes)")
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._closer = weakref.finalize(self, os.close, self.fd)
        self.size = size
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.mv = memoryview(self.mm)

    def owner_alive(self) -> bool:
        """`owner_alive` of this file: False once its owner died or unregistered it."""
        return owner_alive(self.fd)

    def close(self) -> None:
        """Unmap (deferred to the garbage collector while a caller still holds a view) and
        close the fd; only when no other thread is copying through this mapping."""
        with contextlib.suppress(BufferError):
            self.mv.release()
        with contextlib.suppress(AttributeError):
            del self.arr
        with contextlib.suppress(BufferError):
            self.mm.close()
        self._closer()
