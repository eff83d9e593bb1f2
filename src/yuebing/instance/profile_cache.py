"""The on-disk cache of start-up profiles, keyed by engine configuration, machine and role.

`instance.startup_profile` (yuebing's engine) and `integrations.vllm.profile` (a vLLM server)
call `cached_profile` with their configuration and a function that measures one. Profiles live
under ``$XDG_CACHE_HOME/yuebing/profiles``, one file per configuration and role; a file whose
configuration is not this one is never used (re-measured). Profilers sharing the directory
measure one at a time (a file lock): two side by side would each measure the other's load; a
server that starts (`starting`: an instance or a vLLM loading) holds the lock shared, so no
profile runs while a sibling loads; `measuring` tells the supervisor one runs. An unusable
directory (read-only, no home) is logged: profiles are measured without the cache.
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

import msgspec

from yuebing.core import env
from yuebing.protocol.instance import EngineProfile, Role
from yuebing.transfer.liveness import owner_alive

log = logging.getLogger(__name__)


def profile_dir() -> Path:
    """Where cached profiles live (``$XDG_CACHE_HOME/yuebing/profiles`` or ~/.cache/...)."""
    return env.cache_home() / "yuebing" / "profiles"


def cache_key(signature: dict[str, str], role: Role, grid: int, lent_threads: int = 0) -> str:
    """The file name (without ``.json``) of ``signature``'s profile for ``role`` on grid
    version ``grid`` (a new grid makes old cached profiles stale), with prefills also timed
    at ``lent_threads`` (0: not)."""
    lent = {"lent_threads": lent_threads} if lent_threads else {}
    what = json.dumps({"grid": grid, "prefill": role != Role.DECODE,
                       "decode": role != Role.PREFILL, **lent, **signature}, sort_keys=True)
    return hashlib.blake2b(what.encode(), digest_size=10).hexdigest()


def cached_profile(signature: dict[str, str], role: Role, grid: int,
                   measure: Callable[[], EngineProfile], cache: Path | None = None,
                   lent_threads: int = 0) -> EngineProfile:
    """The profile cached for ``signature``, ``role`` and ``lent_threads`` under ``cache``
    (default `profile_dir`), or ``measure()``'s, then cached."""
    try:
        root = cache or profile_dir()
    except RuntimeError as e:  # no home directory to find the cache in
        log.warning("start-up profile: no cache directory (%s); measuring without it", e)
        return measure()
    try:
        path = root / f"{cache_key(signature, role, grid, lent_threads)}.json"
        cached = _read(path, signature)
        if cached is not None:
            log.info("start-up profile: cached %s", path)
            return cached
        with _cache_lock(root):
            cached = _read(path, signature)  # another instance may have taken it meanwhile
            return cached if cached is not None else _measure_and_save(measure, path)
    except OSError as e:  # read-only, not a directory: not a failing measurement's RuntimeError
        log.warning("start-up profile: the cache cannot be used (%s); measuring without it", e)
        return measure()


def peek(signature: dict[str, str], role: Role, grid: int, cache: Path | None = None,
         lent_threads: int = 0) -> EngineProfile | None:
    """The profile cached for these, or None (nothing measured, no lock; an unusable cache
    is None too)."""
    try:
        root = cache or profile_dir()
        return _read(root / f"{cache_key(signature, role, grid, lent_threads)}.json", signature)
    except (RuntimeError, OSError):
        return None


def _measure_and_save(measure: Callable[[], EngineProfile], path: Path) -> EngineProfile:
    t0 = time.perf_counter()
    profile = measure()
    log.info("start-up profile: %s prefill and %s decode points in %.1f s -> %s",
             len(profile.prefill), len(profile.decode), time.perf_counter() - t0, path)
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(profile))
        tmp.replace(path)
    except OSError as e:
        log.warning("start-up profile: not cached (%s)", e)
    return profile


def _read(path: Path, signature: dict[str, str]) -> EngineProfile | None:
    """The profile cached at ``path`` if it is one of this very signature, else None."""
    try:
        profile = msgspec.json.decode(path.read_bytes(), type=EngineProfile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return profile if profile.configuration == signature else None


@contextlib.contextmanager
def starting(cache: Path | None = None) -> Iterator[None]:
    """Hold the profilers' lock shared while a server starts: a profile measured meanwhile would
    time the start-up's load with it. Servers start side by side; a profiler waits for them all,
    and a server starting while one measures waits for it. Without a usable cache directory:
    no lock."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_cache_lock(cache or profile_dir(), shared=True))
        except (RuntimeError, OSError) as e:  # no home, read-only: start without the lock
            log.warning("start-up profile: no lock to start under (%s)", e)
        yield


def measuring(cache: Path | None = None) -> bool:
    """Whether a start-up profile measures now (the lock is held exclusively): the
    supervisor's ready deadlines wait meanwhile. No cache directory: False."""
    try:
        f = open((cache or profile_dir()) / ".lock", "rb")  # noqa: SIM115 - closed below
    except (RuntimeError, OSError):
        return False
    with f:
        return owner_alive(f.fileno())  # an exclusive holder, as of a segment file's owner


@contextlib.contextmanager
def _cache_lock(root: Path, shared: bool = False) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
