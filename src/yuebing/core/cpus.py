"""CPU lists like ``0-3,6``: parse one (`parse_cpus`, a precise `ConfigError` for bad input),
print one (`format_cpus`), this process's usable CPUs (`usable_cpus`) and their split among
the instances one host runs (`split_cpus`). Used by ``yuebing vllm instance --cpus``
(`integrations.vllm`) and by ``yuebing serve --engine vllm`` (`cluster.serve`)."""

from __future__ import annotations

import os
import re
from collections import Counter

from yuebing.core.config import require

_PART = re.compile(r"([0-9]+)(?:-([0-9]+))?")
MAX_CPU = (1 << 16) - 1
"""The highest CPU number a list may name (checked before a range is expanded)."""


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity), ascending."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))  # pragma: no cover - not Linux


def parse_cpus(text: str, flag: str = "--cpus") -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``; `ConfigError` naming ``flag`` and the bad part for an
    empty list, a part that is not N or N-M, a CPU above `MAX_CPU`, a range that runs backwards
    or a repeated CPU."""
    out: list[int] = []
    require(bool(text.strip()), f"{flag}: empty CPU list (give e.g. 1, 0-3 or 0,2-3)")
    for part in text.split(","):
        m = _PART.fullmatch(part.strip())
        require(m is not None, f"{flag} {text!r}: {part.strip()!r} is not a CPU number N or a "
                "range N-M (give e.g. 1, 0-3 or 0,2-3)")
        assert m is not None
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        top = max(lo, hi)
        require(top <= MAX_CPU, f"{flag} {text!r}: CPU {top} in {part.strip()!r} is above "
                f"{MAX_CPU}, the highest CPU number taken")
        require(lo <= hi, f"{flag} {text!r}: range {part.strip()!r} runs backwards")
        out.extend(range(lo, hi + 1))
    dup = sorted(c for c, k in Counter(out).items() if k > 1)
    require(not dup, f"{flag} {text!r}: CPU {format_cpus(tuple(dup))} given twice")
    return tuple(sorted(out))


def require_usable(cpus: tuple[int, ...], flag: str = "--cpus") -> None:
    """`ConfigError` unless this process may run on every CPU of ``cpus``."""
    usable = usable_cpus()
    allowed = set(usable)
    bad = tuple(c for c in cpus if c not in allowed)
    require(not bad, f"{flag} {format_cpus(cpus)}: CPU {format_cpus(bad)} is not one this "
            f"process may run on (usable: {format_cpus(usable)})")


def format_cpus(cpus: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (ascending, runs as ranges)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    parts = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs]
    return ",".join(parts)


def split_cpus(cpus: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """``cpus`` shared among ``n`` instances, every one the same number of CPUs (its thread
    count is part of its engine configuration, so instances of one role must match): when
    there are at least ``n`` CPUs, disjoint runs of ``len(cpus) // n``, a run being
    consecutive in ``cpus`` (not necessarily in number: ``(2, 5)`` is one), the remainder at
    the end left to no instance (the control plane's); else one CPU each, round robin
    (instances share a CPU only then)."""
    require(n >= 1 and bool(cpus), f"cannot split {len(cpus)} CPUs among {n} instances")
    if len(cpus) < n:
        return [(cpus[i % len(cpus)],) for i in range(n)]
    size = len(cpus) // n
    return [tuple(cpus[i * size:(i + 1) * size]) for i in range(n)]
