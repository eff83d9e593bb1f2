"""Segments: memory a process registers so peers can read and write it.

Life cycle: the owner calls `TransferEngine.register_segment`, which builds a `Segment` here
(shared-memory file under /dev/shm, mapped; or a caller-provided buffer such as a numpy array or
torch CPU tensor), adds it to the engine's `SegmentTable` and publishes its `SegmentDescriptor`.
Every remote access arriving over TCP is checked by `SegmentTable.resolve` against the
registered range before a byte moves; shared-memory peers check the same range against the
published descriptor. `unregister` withdraws the descriptor and unmaps/unlinks the file.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import threading

import numpy as np

from yuebing.core.errors import InputError, TransferError
from yuebing.transfer.messages import SegmentDescriptor
from yuebing.transfer.types import as_buffer

log = logging.getLogger(__name__)

SHM_PREFIX = "yuebing-tx-"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/@-]{1,200}$")
_counter = itertools.count()


def check_range(name: str, size: int, offset: int, length: int) -> None:
    """Raise `TransferError` unless [offset, offset+length) lies inside a segment of ``size``."""
    if offset < 0 or length <= 0 or offset + length > size:
        raise TransferError(
            f"access [{offset}, {offset + length}) is outside segment {name!r} of {size} bytes")


class Segment:
    """A registered memory region. ``view`` is a writable flat memoryview of all of it."""

    def __init__(self, name: str, view: memoryview, shm_path: str = "",
                 mapping: mmap.mmap | None = None) -> None:
        self.name = name
        self.view = view
        self.size = view.nbytes
        self.shm_path = shm_path
        self._mapping = mapping

    @property
    def array(self) -> np.ndarray:
        """The segment as a uint8 numpy array (a view, no copy)."""
        return np.frombuffer(self.view, dtype=np.uint8)

    def descriptor(self, engine_id: str, host_id: str, address: str) -> SegmentDescriptor:
        return SegmentDescriptor(name=self.name, engine_id=engine_id, host_id=host_id,
                                 address=address, size=self.size, shm_path=self.shm_path)

    def close(self) -> None:
        """Unmap and unlink a shared-memory segment (buffers the caller gave stay theirs)."""
        self.view.release()
        if self._mapping is not None:
            with contextlib.suppress(BufferError):
                self._mapping.close()  # BufferError: a numpy view is still alive; GC unmaps
            self._mapping = None
        if self.shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)


def validate_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InputError(f"segment name {name!r} must be 1-200 chars of [A-Za-z0-9_.:/@-]")


def create_shm_segment(name: str, size: int, shm_dir: str, prefault: bool) -> Segment:
    """A new zero-filled shared-memory segment backed by a file in ``shm_dir``."""
    if not isinstance(size, int) or size <= 0:
        raise InputError(f"segment size must be a positive int, got {size!r}")
    path = os.path.join(shm_dir, f"{SHM_PREFIX}{os.getpid()}-{next(_counter)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.unlink(path)
        raise InputError(f"cannot create a {size}-byte shared-memory segment: {e}") from None
    finally:
        os.close(fd)
    if prefault:
        np.frombuffer(mapping, dtype=np.uint8).fill(0)  # touch every page now, not mid-transfer
    return Segment(name, memoryview(mapping), shm_path=path, mapping=mapping)


def wrap_buffer_segment(name: str, buffer: object) -> Segment:
    """A segment over caller-owned memory (numpy array, bytearray, torch CPU tensor...)."""
    return Segment(name, as_buffer(buffer, writable=True))


def sweep_stale_shm(shm_dir: str) -> int:
    """Unlink segment files that this user's processes left when they died without cleaning
    up (the file name carries the creator's pid); returns how many were removed."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm_dir):
            m = re.match(rf"^{SHM_PREFIX}(\d+)-\d+$", entry.name)
            if m and entry.stat().st_uid == os.getuid() and not _pid_alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SegmentTable:
    """The engine's registered segments by name; thread-safe; validates every access."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: dict[str, Segment] = {}

    def add(self, seg: Segment) -> None:
        with self._lock:
            if seg.name in self._segments:
                raise InputError(f"segment {seg.name!r} is already registered")
            self._segments[seg.name] = seg

    def remove(self, name: str) -> Segment:
        with self._lock:
            seg = self._segments.pop(name, None)
        if seg is None:
            raise InputError(f"segment {name!r} is not registered here")
        return seg

    def get(self, name: str) -> Segment | None:
        return self._segments.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._segments)

    def all(self) -> list[Segment]:
        with self._lock:
            return list(self._segments.values())

    def resolve(self, name: str, offset: int, length: int,
                span: tuple[int, int] | None = None) -> memoryview:
        """The registered bytes [offset, offset+length) of ``name``, or `TransferError`. With
        ``span`` (the whole request's range) that range is checked too, and must contain the
        slice, so every slice of a partly out-of-range request is refused."""
        seg = self._segments.get(name)
        if seg is None:
            raise TransferError(f"segment {name!r} is not registered on the target")
        if span is not None:
            check_range(name, seg.size, span[0], span[1])
            if offset < span[0] or offset + length > span[0] + span[1]:
                raise TransferError(f"slice [{offset}, {offset + length}) lies outside its "
                                    f"request [{span[0]}, {span[0] + span[1]})")
        check_range(name, seg.size, offset, length)
        return seg.view[offset:offset + length]
