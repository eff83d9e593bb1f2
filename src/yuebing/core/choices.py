"""Start-up choices measured once per machine and read by every later process
(`shared_choice`): the engine's attention paths and fused-decode rows (`engine.choices`), the
transfer engine's TCP lane count (`transfer.lanes`).

Timing under load can tip a close race either way, and two processes of one cluster that pick
differently run two configurations. So the first process measures, under a file lock, and keeps
the choice in ``$XDG_CACHE_HOME/yuebing/choices/<key>.json``; the others read it. The key hashes
what the caller names (the machine — `machine_parts` —, versions, candidates), so any change
measures again (as does deleting the directory). An unusable cache is logged and the choice
measured anyway.

A measurement is only as good as the host was quiet: on the first start of `yuebing serve` every
process starts at once, and a copy split over two threads loses to one thread when the other
core is busy (a 2-core Xeon measured "never split" beside a pip install, 1.2x split quiet). So a
choice records whether other work used more than `QUIET_SHARE` of the CPUs just before or after
it was measured (`host_busy`); a busy one is provisional: used, and measured again by the first
process that finds the host quiet (`YUEBING_KEEP_CHOICES=1`: never, e.g. under tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from yuebing.core import env
from yuebing.core.host import cpu_name

log = logging.getLogger(__name__)

T = TypeVar("T")

QUIET_SHARE = 0.25
"""A host is quiet while other work uses at most this share of its CPUs (`host_busy`)."""
SAMPLE_S = 0.2
"""How long `host_busy` watches the host."""
_sampled: tuple[float, float] | None = None
"""This process's latest `host_busy` (monotonic time, share): reused for a second."""


def choice_dir() -> Path:
    return env.cache_home() / "yuebing" / "choices"


def machine_parts() -> dict[str, object]:
    """This machine as a choice's key names it: the processor and the CPUs this process may
    run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_name(), "cpus": cpus}


def choice_key(parts: dict[str, object]) -> str:
    """The cache file name of ``parts`` (a stable hash of their JSON)."""
    what = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(what.encode(), digest_size=10).hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path, parse: Callable[[Any], T]) -> tuple[T, bool] | None:
    """The kept choice and whether it was measured on a quiet host (False for a choice kept
    before quietness was recorded), or None."""
    try:
        kept = json.loads(path.read_text())
        return parse(kept["value"]), kept.get("quiet") is True
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        log.warning("start-up choice %s unreadable (%s); measuring again", path, e)
    return None


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of every CPU of the host (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is counted in user already
    return total - idle, total


def host_busy() -> float:
    """The share of the host's CPUs that other work used over `SAMPLE_S` while this thread
    slept (0 where ``/proc/stat`` cannot be read: counted as quiet); the last answer is
    reused for a second."""
    global _sampled
    now = time.monotonic()
    if _sampled is not None and now - _sampled[0] < 1.0:
        return _sampled[1]
    before, own = _cpu_times(), time.process_time()
    time.sleep(SAMPLE_S)
    after, own = _cpu_times(), time.process_time() - own
    share = 0.0
    if before is not None and after is not None and after[1] > before[1]:
        cpus = os.cpu_count() or 1
        busy = (after[0] - before[0]) / (after[1] - before[1])
        share = max(0.0, busy - own / SAMPLE_S / cpus)  # less this process's other threads
    _sampled = (time.monotonic(), share)
    return share


def _busy_after() -> float:
    """`host_busy` sampled afresh (after a measurement)."""
    global _sampled
    _sampled = None
    return host_busy()


def shared_choice(parts: dict[str, object], measure: Callable[[], T],
                  parse: Callable[[Any], T], root: Path | None = None) -> tuple[T, bool]:
    """The machine's choice for ``parts`` (and True), or ``measure()``'s, kept for the next
    process (and False). ``parse`` turns the kept JSON back into a choice, raising
    ValueError, KeyError, TypeError or IndexError on a malformed one (measured again).
    Measurements of all kinds take turns (one lock): each would time the other's load; a kept
    choice is read without the lock, so a measurement's own helper processes never wait on it.
    A provisional choice (measured on a busy host) is measured again when the host is quiet
    (module docstring)."""
    try:
        base = root or choice_dir()
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{choice_key(parts)}.json"
        found = _read(path, parse)  # kept ones are read without waiting (written atomically)
        if found is not None and (found[1] or env.keep_choices() or host_busy() > QUIET_SHARE):
            return found[0], True
        with _locked(base / ".lock"):
            again = _read(path, parse)
            if again is not None and (again[1] or again != found):  # measured meanwhile
                return again[0], True
            busy = host_busy()
            choice = measure()
            busy = max(busy, _busy_after())
            quiet = busy <= QUIET_SHARE
            if not quiet:
                log.info("start-up choice %s measured while other work used %.0f%% of the "
                         "CPUs: provisional, measured again on a quiet start", path.name,
                         100 * busy)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"value": choice, "parts": parts, "quiet": quiet},
                                      default=str, indent=1))
            os.replace(tmp, path)
            return choice, False
    except (OSError, RuntimeError) as e:  # read-only cache, no home directory
        log.warning("start-up choice: no usable cache (%s); measuring without it", e)
        return measure(), False
