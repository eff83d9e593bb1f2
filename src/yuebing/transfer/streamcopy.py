"""Large copies into and out of shared-memory segments.

Called by the shared-memory transport's copy threads (`yuebing.transfer.transport.shm`) and the
store client's same-host direct path (`yuebing.store.client.direct`) for copies above their
small-copy limit. `copy` uses the C extension `yuebing.transfer._streamcopy` (built by ``pip
install`` when a C compiler is there): non-temporal stores, which skip the read of each
destination cache line a plain memcpy does first and leave the caches alone — about 1.5–2× the
copy rate of ``numpy.copyto`` into a segment on the machines we measured (docs/benchmarks.md).
Without the extension, or with ``YUEBING_STREAM_COPY=0`` in the environment, it is
``numpy.copyto``. Both release the GIL while copying. Copies up to `small_copy` bytes are a
memoryview assignment instead: the limits are measured once per machine (`core.choices`).
"""

from __future__ import annotations

import logging
import statistics
import time
from types import ModuleType
from typing import Any

import numpy as np

from yuebing.core import env
from yuebing.core.choices import machine_parts, shared_choice

log = logging.getLogger(__name__)

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


SMALL_DEFAULT = 256 << 10
"""The small-copy limit without streaming stores (``numpy.copyto`` and an assignment are both
plain memcpy; the assignment's call is cheaper)."""
SMALL_CANDIDATES = (64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20)
SMALL_VERSION = 4
"""Bump when the measurement changes: every machine measures again."""
_small: tuple[int, int] | None = None


def small_copy(read: bool = False) -> int:
    """Copies of at most this many bytes are a memoryview assignment (cheapest call; holds the
    GIL), larger ones `copy`. With streaming stores it is this machine's, for writes into a
    segment (cold memory) and for ``read``s out of one into the caller's buffer (warm: reused):
    the candidate of `SMALL_CANDIDATES` that makes the measured copies cheapest
    (`least_cost_limit`), measured once per machine and kept; `SMALL_DEFAULT` otherwise.
    Settled at the first call in a process (`TransferEngine`)."""
    global _small
    if not _streaming:
        return SMALL_DEFAULT
    if _small is None:
        parts = {"kind": "transfer.small_copy", "version": SMALL_VERSION, **machine_parts(),
                 "candidates": SMALL_CANDIDATES}
        (write, rd, timings), kept = shared_choice(parts, measure_small_copy, small_choice)
        _small = (write, rd)
        log.info("small-copy limits: writes %d, reads %d bytes (%s); µs per copy, "
                 "assignment / streaming: %s", write, rd,
                 "kept for this machine" if kept else "measured now", timings)
    return _small[1] if read else _small[0]


def small_choice(raw: Any) -> tuple[int, int, dict[str, dict[str, list[float]]]]:
    """`measure_small_copy`'s (write limit, read limit, timings) from JSON."""
    write, rd, timings = raw
    if not all(isinstance(x, int) and 0 < x <= 1 << 30 for x in (write, rd)) or \
            not isinstance(timings, dict) or not all(isinstance(v, dict) for v in timings.values()):
        raise TypeError(f"not a small-copy choice: {raw!r}")
    return write, rd, {str(k): {str(n): [float(x) for x in t] for n, t in v.items()}
                       for k, v in timings.items()}


def measure_small_copy(reps: int = 25, arena: int = 64 << 20
                       ) -> tuple[int, int, dict[str, dict[str, list[float]]]]:
    """The write and read limits: writes go from one buffer into the next place of an
    ``arena`` of touched memory (cold, as a segment's), reads from the next place of it into
    one reused buffer (warm, as a caller's). Timings: µs per copy, [assignment, streaming]."""
    big = np.ones(arena, np.uint8)
    one = np.ones(SMALL_CANDIDATES[-1], np.uint8)
    wt = _timings(big, one, reps, into_arena=True)
    rt = _timings(big, one, reps, into_arena=False)
    return least_cost_limit(wt), least_cost_limit(rt), {"write": wt, "read": rt}


def least_cost_limit(timings: dict[str, list[float]]) -> int:
    """The candidate limit under which the timed copies cost least per byte, summed over every
    candidate size: assignments up to it, streaming above. A sum over all sizes, not the
    first size where streaming wins: one noisy crossing (a machine busy at start-up) must not
    decide it."""
    sizes = sorted(int(k) for k in timings)
    per_byte = [(timings[str(n)][0] / n, timings[str(n)][1] / n) for n in sizes]

    def cost(i: int) -> float:
        return sum(p for p, _ in per_byte[:i + 1]) + sum(s for _, s in per_byte[i + 1:])

    return sizes[min(range(len(sizes)), key=cost)]


def _timings(big: np.ndarray, one: np.ndarray, reps: int,
             into_arena: bool) -> dict[str, list[float]]:
    """Median µs of an assignment and of `copy` per candidate size between the next place of
    ``big`` and ``one``: ``reps`` rounds over all sizes, the two taking turns first, so a
    drift of the machine's speed hits every size and both alike. Each timed copy follows an
    untimed one of the same kind: a read into ``one`` finds it as its own kind leaves it
    (streaming stores evict it, an assignment keeps it cached). Timed one after the other, the
    assignment paid for the eviction: an AMD EPYC (Zen 3) got a 128 KiB read limit where 2 MiB
    is right, and same-host gets 4–8 % slower (`benchmarks/store_read_copy_ab.py`)."""
    took: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in SMALL_CANDIDATES}
    at = 0
    for r in range(reps):
        for size in SMALL_CANDIDATES:
            for streamed in (r % 2 == 0, r % 2 == 1):
                for timed in (False, True):
                    at = at + size if at + 2 * size <= big.nbytes else 0
                    place, mine = big[at:at + size], one[:size]
                    dst, src = (place, mine) if into_arena else (mine, place)
                    dmv, smv = dst.data, src.data
                    t0 = time.perf_counter()
                    if streamed:
                        copy(dst, src)
                    else:
                        dmv[:] = smv
                    if timed:
                        took[size][streamed].append(time.perf_counter() - t0)
    return {str(n): [round(statistics.median(t) * 1e6, 2) for t in took[n]]
            for n in SMALL_CANDIDATES}
