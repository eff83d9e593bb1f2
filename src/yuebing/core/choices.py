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
choice records whether other work used more than `QUIET_SHARE` of its CPUs just before or after
it was measured (`host_busy`). A busy one of the speed-only kinds (copy limits, lanes) is
provisional: used, and measured again by the first process that finds the host quiet
(`YUEBING_KEEP_CHOICES=1`: never, e.g. under tests). The engine's choices stay as first measured
(``remeasure=False``): they name its configuration, which the Conductor holds every instance of
a cluster to.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
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


def _cpu_times(cpus: set[int], stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) jiffies of the CPUs ``cpus`` (``/proc/stat``'s ``cpuN`` lines), or None."""
    busy = total = 0
    try:
        with open(stat) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or not name[3:].isdigit() \
                        or int(name[3:]) not in cpus:
                    continue
                fields = [int(x) for x in rest.split()[:8]]  # guest time is in user already
                idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
                busy, total = busy + sum(fields) - idle, total + sum(fields)
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def _own_cpu_s() -> float:
    """This thread's CPU time: the process's other threads count as other work (a choice
    measured on a background thread is timed beside them)."""
    return time.thread_time()


def _pause(seconds: float) -> None:
    time.sleep(seconds)


def host_busy() -> float:
    """The share of the CPUs this process may run on that other work used over `SAMPLE_S`
    while this thread slept: their busy jiffies less this thread's own CPU time (0 where
    ``/proc/stat`` cannot be read: counted as quiet)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else \
        set(range(os.cpu_count() or 1))
    before, own = _cpu_times(cpus), _own_cpu_s()
    if before is None:
        return 0.0
    _pause(SAMPLE_S)
    after, own = _cpu_times(cpus), _own_cpu_s() - own
    if after is None or after[1] <= before[1]:
        return 0.0
    own_ticks = own * os.sysconf("SC_CLK_TCK")
    return max(0.0, (after[0] - before[0] - own_ticks) / (after[1] - before[1]))


def kept_choice(parts: dict[str, object], parse: Callable[[Any], T],
                root: Path | None = None) -> tuple[T, bool] | None:
    """The choice kept for ``parts`` and whether it was measured on a quiet host, read without
    measuring or waiting (None: nothing usable kept, or no cache). For callers that must not
    block on a measurement (`shared_choice` then runs off their path)."""
    try:
        return _read((root or choice_dir()) / f"{choice_key(parts)}.json", parse)
    except RuntimeError:  # no home directory
        return None


def shared_choice(parts: dict[str, object], measure: Callable[[], T],
                  parse: Callable[[Any], T], root: Path | None = None, *,
                  remeasure: bool = True) -> tuple[T, bool]:
    """The machine's choice for ``parts`` (and True), or ``measure()``'s, kept for the next
    process (and False). ``parse`` turns the kept JSON back into a choice, raising
    ValueError, KeyError, TypeError or IndexError on a malformed one (measured again).
    Measurements of all kinds take turns (one lock): each would time the other's load. A
    quiet choice is read without the lock, so a measurement's own helper processes never wait
    on it (they run with `YUEBING_KEEP_CHOICES`). A provisional one (measured on a busy host)
    is measured again under the lock when the host is quiet (module docstring), unless
    ``remeasure`` is False: a choice that names the engine's configuration must not change
    under a running cluster."""
    try:
        base = root or choice_dir()
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{choice_key(parts)}.json"
        lock = open(base / ".lock", "a")  # noqa: SIM115 - held past this block
    except (OSError, RuntimeError) as e:  # read-only cache, no home directory
        log.warning("start-up choice: no usable cache (%s); measuring without it", e)
        return measure(), False
    with lock:
        found = _read(path, parse)  # kept ones are read without waiting (written atomically)
        if found is not None and (found[1] or not remeasure or env.keep_choices()):
            return found[0], True
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        found = _read(path, parse)  # measured meanwhile, or still provisional
        if found is not None and (found[1] or not remeasure):
            return found[0], True
        busy = host_busy()  # nobody else measures now
        if found is not None and busy > QUIET_SHARE:
            return found[0], True
        choice = measure()
        busy = max(busy, host_busy())
        quiet = busy <= QUIET_SHARE
        if not quiet:
            log.info("start-up choice %s measured while other work used %.0f%% of the CPUs: "
                     "%s", path.name, 100 * busy, "provisional, measured again on a quiet "
                     "start" if remeasure else "kept")
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"value": choice, "parts": parts, "quiet": quiet},
                                      default=str, indent=1))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("start-up choice %s not kept: %s", path.name, e)
        return choice, False
