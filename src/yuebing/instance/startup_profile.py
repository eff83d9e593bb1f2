"""An instance's start-up profile of its own engine, which the Conductor fits its predictors to.

`Instance` calls `startup_profile` once when it starts (``--startup-profile``, on by default):
roles that prefill time a grid of prompts, roles that decode a grid of batches, on the engine
they will serve with. The result is cached per engine signature (`LLMEngine.signature`: the
configuration and the machine) under ``$XDG_CACHE_HOME/yuebing/profiles``, so only the first
start of a configuration on a machine pays (seconds). Instances sharing that cache directory
profile one at a time (a file lock): two profiling side by side would each measure the other's
load.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from yuebing.core import env
from yuebing.engine.engine import LLMEngine
from yuebing.engine.profile import _Tokens, time_decode, time_prefill
from yuebing.protocol.instance import EngineProfile, Role

log = logging.getLogger(__name__)

GRID_VERSION = 1
"""Part of the cache key: a new grid makes old cached profiles stale."""
PREFILL_NEW = (128, 512, 1536, 4096)
PREFILL_CACHED = (0, 1024)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (512, 4096)


def profile_dir() -> Path:
    """Where cached profiles live (``$XDG_CACHE_HOME/yuebing/profiles`` or ~/.cache/...)."""
    return env.cache_home() / "yuebing" / "profiles"


def cache_key(signature: dict[str, str], role: Role) -> str:
    what = json.dumps({"grid": GRID_VERSION, "prefill": role != Role.DECODE,
                       "decode": role != Role.PREFILL, **signature}, sort_keys=True)
    return hashlib.blake2b(what.encode(), digest_size=10).hexdigest()


def startup_profile(engine: LLMEngine, role: Role, cache: Path | None = None) -> EngineProfile:
    """The cached profile of this engine's signature for ``role``, or a fresh one (cached; an
    unusable cache directory — read-only, no home — is logged and the profile measured anyway)."""
    signature = engine.signature()
    try:
        root = cache or profile_dir()
    except RuntimeError as e:  # no home directory to find the cache in
        log.warning("start-up profile: no cache directory (%s); measuring without it", e)
        return measure(engine, role, signature)
    try:
        path = root / f"{cache_key(signature, role)}.json"
        cached = _read(path, signature)
        if cached is not None:
            log.info("start-up profile: cached %s", path)
            return cached
        with _cache_lock(root):
            cached = _read(path, signature)  # another instance may have taken it meanwhile
            return cached if cached is not None else \
                _measure_and_save(engine, role, signature, path)
    except OSError as e:  # read-only, not a directory: not a failing measurement's RuntimeError
        log.warning("start-up profile: the cache cannot be used (%s); measuring without it", e)
        return measure(engine, role, signature)


def _measure_and_save(engine: LLMEngine, role: Role, signature: dict[str, str],
                      path: Path) -> EngineProfile:
    t0 = time.perf_counter()
    profile = measure(engine, role, signature)
    log.info("start-up profile: %s prefill and %s decode points in %.1f s -> %s",
             len(profile.prefill), len(profile.decode), time.perf_counter() - t0, path)
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(profile))
        tmp.replace(path)
    except OSError as e:
        log.warning("start-up profile: not cached (%s)", e)
    return profile


def measure(engine: LLMEngine, role: Role, signature: dict[str, str]) -> EngineProfile:
    """Time this role's grid on ``engine`` (points past its context or batch limits skipped)."""
    tokens = _Tokens(engine.model_config.vocab_size, seed=random.randrange(1 << 31))
    # fresh prompts on every call: another role's grid on the same engine must not hit them
    bs, limit = engine.block_size, engine.max_model_len
    engine.warmup()
    prefill: list[tuple[int, int, float]] = []
    if role != Role.DECODE:
        for cached in PREFILL_CACHED:
            for new in PREFILL_NEW:
                if cached % bs == 0 and cached + new + 1 < limit:
                    prefill.append((new, cached, time_prefill(engine, new, cached, tokens).wall))
    decode: list[tuple[int, int, float]] = []
    if role != Role.PREFILL:
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                if batch <= min(context, engine.config.max_num_seqs) \
                        and context // batch + 16 < limit:
                    decode.append((batch, context,
                                   time_decode(engine, batch, context, tokens).wall))
    return EngineProfile(configuration=signature, prefill=prefill, decode=decode)


def _read(path: Path, signature: dict[str, str]) -> EngineProfile | None:
    """The profile cached at ``path`` if it is one of this very signature, else None."""
    try:
        profile = msgspec.json.decode(path.read_bytes(), type=EngineProfile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return profile if profile.configuration == signature else None


@contextlib.contextmanager
def _cache_lock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

