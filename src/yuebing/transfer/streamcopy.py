"""Large copies into and out of shared-memory segments.

Called by the shared-memory transport's copy threads (`yuebing.transfer.transport.shm`) and the
store client's same-host direct path (`yuebing.store.client.direct`) for copies above their
small-copy limit. `copy` uses the C extension `yuebing.transfer._streamcopy` (built by ``pip
install`` when a C compiler is there): non-temporal stores, which skip the read of each
destination cache line a plain memcpy does first and leave the caches alone — about 1.5–2× the
copy rate of ``numpy.copyto`` into a segment on the machines we measured (docs/benchmarks.md).
Without the extension, or with ``YUEBING_STREAM_COPY=0`` in the environment, it is
``numpy.copyto``. Both release the GIL while copying.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from yuebing.core import env

_native: ModuleType | None
try:
    from yuebing.transfer import _streamcopy as _native
except ImportError:  # no C compiler at install time
    _native = None

BUILT = _native is not None
"""Whether the C extension is importable."""

_streaming = BUILT and env.stream_copy()


def streaming() -> bool:
    """Whether `copy` uses streaming stores now."""
    return _streaming


def set_streaming(on: bool) -> None:
    """Turn streaming stores on or off for this process (benchmarks compare both in one run);
    on only takes effect where the extension is built."""
    global _streaming
    _streaming = BUILT and on


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst``: contiguous uint8 arrays of the same length."""
    if _streaming:
        _native.copy(dst, src)  # type: ignore[union-attr]
    else:
        np.copyto(dst, src)
