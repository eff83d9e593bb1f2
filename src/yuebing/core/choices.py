"""Start-up choices measured once per machine and read by every later process
(`shared_choice`): the engine's attention paths and fused-decode rows (`engine.choices`), the
transfer engine's TCP lane count (`transfer.lanes`).

Timing under load can tip a close race either way, and two processes of one cluster that pick
differently run two configurations. So the first process measures, under a file lock, and keeps
the choice in ``$XDG_CACHE_HOME/yuebing/choices/<key>.json``; the others read it. The key hashes
what the caller names (the machine — `machine_parts` —, versions, candidates), so any change
measures again (as does deleting the directory). An unusable cache is logged and the choice
measured anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from yuebing.core import env
from yuebing.core.host import cpu_name

log = logging.getLogger(__name__)

T = TypeVar("T")


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


def _read(path: Path, parse: Callable[[Any], T]) -> T | None:
    try:
        return parse(json.loads(path.read_text())["value"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        log.warning("start-up choice %s unreadable (%s); measuring again", path, e)
    return None


def shared_choice(parts: dict[str, object], measure: Callable[[], T],
                  parse: Callable[[Any], T], root: Path | None = None) -> tuple[T, bool]:
    """The machine's choice for ``parts`` (and True), or ``measure()``'s, kept for the next
    process (and False). ``parse`` turns the kept JSON back into a choice, raising
    ValueError, KeyError, TypeError or IndexError on a malformed one (measured again).
    Measurements of all kinds take turns (one lock): each would time the other's load; a kept
    choice is read without the lock, so a measurement's own helper processes never wait on it."""
    try:
        base = root or choice_dir()
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{choice_key(parts)}.json"
        found = _read(path, parse)  # kept ones are read without waiting (written atomically)
        if found is not None:
            return found, True
        with _locked(base / ".lock"):
            found = _read(path, parse)
            if found is not None:
                return found, True
            choice = measure()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"value": choice, "parts": parts}, default=str,
                                      indent=1))
            os.replace(tmp, path)
            return choice, False
    except (OSError, RuntimeError) as e:  # read-only cache, no home directory
        log.warning("start-up choice: no usable cache (%s); measuring without it", e)
        return measure(), False
