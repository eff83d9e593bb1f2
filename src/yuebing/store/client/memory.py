"""Memory for the values a client's ``get`` / ``batch_get`` return in new buffers.

Who calls: `StoreClient` / `AsyncStoreClient` once at construction (`keep_freed_memory`) and for
every value they allocate (`new_buffer`). Two costs dominate a bytes-returning read of multi-MiB
values, not the transfer: ``bytearray(n)`` zero-fills its memory only for the read to overwrite
it, and glibc gives large freed blocks back to the kernel (``munmap``, heap trimming), so the
next call's buffers are fresh pages whose first touch page-faults (~40 ms per 64 MiB here, as
long as receiving the bytes). `new_buffer` allocates without zero-filling; `keep_freed_memory`
raises glibc's mmap and trim thresholds so freed value buffers stay in the heap for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20
"""glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)."""

_kept = 0

_from_size: Any = None
try:
    _from_size = ctypes.pythonapi.PyByteArray_FromStringAndSize
    _from_size.restype = ctypes.py_object
    _from_size.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
except AttributeError:  # not CPython
    _from_size = None


def new_buffer(n: int) -> bytearray:
    """A ``bytearray`` of ``n`` bytes whose contents are undefined (not zero-filled): for a
    caller that overwrites all of it. CPython's ``PyByteArray_FromStringAndSize(NULL, n)``;
    elsewhere a plain ``bytearray(n)``."""
    if n < 0:
        raise ValueError(f"buffer size must be >= 0, got {n}")
    if _from_size is None:
        return bytearray(n)
    out: bytearray = _from_size(None, n)
    return out


def keep_freed_memory(keep_bytes: int) -> bool:
    """Let glibc keep up to ``keep_bytes`` of freed heap (``M_TRIM_THRESHOLD``) and serve blocks
    up to 32 MiB from the heap (``M_MMAP_THRESHOLD``), process-wide, so buffers freed by one
    read are reused, already faulted in, by the next. ``0`` changes nothing. Returns whether
    the thresholds are in effect (False on other C libraries). Only ever raises the trim
    threshold: a second client asking for less keeps the larger one."""
    global _kept
    if keep_bytes <= 0:
        return False
    if keep_bytes <= _kept:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, min(keep_bytes, MAX_MMAP_THRESHOLD))) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, keep_bytes))
    except (OSError, AttributeError):
        ok = False
    if ok:
        _kept = keep_bytes
    else:
        log.info("mallopt unavailable: freed value buffers go back to the OS")
    return ok
