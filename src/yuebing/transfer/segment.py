"""Segments: memory a process registers so peers can read and write it.

Life cycle: the owner calls `TransferEngine.register_segment`, which builds a `Segment` here
(shared-memory file under /dev/shm, mapped; or a caller-provided buffer such as a numpy array or
torch CPU tensor), adds it to the engine's `SegmentTable` and publishes its `SegmentDescriptor`.
Every remote access arriving over TCP is checked by `SegmentTable.resolve` against the
registered range before a byte moves; shared-memory peers check the same range against the
published descriptor. A shared-memory segment's file is locked by its owner for as long as the
segment is registered (`yuebing.transfer.liveness`), so peers can tell a live segment from a dead
or replaced one. Each registration is a new incarnation (a random id in the descriptor).
`unregister` withdraws the descriptor, unlinks the file, releases the lock and unmaps it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import threading

import numpy as np

from yuebing.core.errors import InputError, TransferError
from yuebing.protocol.transfer import SegmentDescriptor
from yuebing.transfer.liveness import create_owned_file
from yuebing.transfer.types import as_buffer, as_int

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/@-]{1,200}$")


def check_range(name: str, size: int, offset: int, length: int) -> None:
    """Raise `TransferError` unless [offset, offset+length) lies inside a segment of ``size``."""
    if offset < 0 or length <= 0 or offset + length > size:
        raise TransferError(
            f"access [{offset}, {offset + length}) is outside segment {name!r} of {size} bytes")


class Segment:
    """A registered memory region. ``view`` is a writable flat memoryview of all of it."""

    def __init__(self, name: str, view: memoryview, shm_path: str = "",
                 mapping: mmap.mmap | None = None, lock_fd: int = -1) -> None:
        self.name = name
        self.view = view
        self.size = view.nbytes
        self.shm_path = shm_path
        self.incarnation = secrets.token_hex(8)
        """Tells this registration from any other of the same name (a peer holding an older
        descriptor notices the change)."""
        self._mapping = mapping
        self._lock_fd = lock_fd

    @property
    def array(self) -> np.ndarray:
        """The segment as a uint8 numpy array (a view, no copy)."""
        return np.frombuffer(self.view, dtype=np.uint8)

    def descriptor(self, engine_id: str, host_id: str, address: str) -> SegmentDescriptor:
        return SegmentDescriptor(name=self.name, engine_id=engine_id, host_id=host_id,
                                 address=address, size=self.size, shm_path=self.shm_path,
                                 incarnation=self.incarnation)

    def close(self) -> None:
        """Unlink, release the owner's lock of and unmap a shared-memory segment (buffers the
        caller gave stay theirs). Peers still mapping the file see its lock free: their copies
        into it are no longer reported done."""
        self.view.release()
        if self.shm_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)
        if self._lock_fd >= 0:  # LOCK_UN: the mapping's own dup of the fd must not keep it
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._mapping is not None:
            with contextlib.suppress(BufferError):
                self._mapping.close()  # BufferError: a numpy view is still alive; GC unmaps
            self._mapping = None


def validate_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InputError(f"segment name {name!r} must be 1-200 chars of [A-Za-z0-9_.:/@-]")


def create_shm_segment(name: str, size: int, shm_dir: str, prefault: bool) -> Segment:
    """A new zero-filled shared-memory segment backed by a file in ``shm_dir``, locked by this
    process as its owner until `Segment.close` (`liveness.create_owned_file`)."""
    size = as_int(size, "segment size", low=1)
    try:
        path, fd = create_owned_file(shm_dir, size)
    except OSError as e:
        raise InputError(f"cannot create a {size}-byte shared-memory segment: {e}") from None
    try:
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.unlink(path)
        os.close(fd)
        raise InputError(f"cannot map a {size}-byte shared-memory segment: {e}") from None
    if prefault:
        np.frombuffer(mapping, dtype=np.uint8).fill(0)  # touch every page now, not mid-transfer
    return Segment(name, memoryview(mapping), shm_path=path, mapping=mapping, lock_fd=fd)


def wrap_buffer_segment(name: str, buffer: object) -> Segment:
    """A segment over caller-owned memory (numpy array, bytearray, torch CPU tensor...)."""
    return Segment(name, as_buffer(buffer, writable=True))


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
