"""An instance's start-up profile of its own engine, which the Conductor fits its predictors to.

`Instance` calls `startup_profile` once when it starts (``--startup-profile``, on by default):
roles that prefill time a grid of prompts, roles that decode a grid of batches, on the engine
they will serve with. A prefill that borrows idle cores (``--lend-cores``) also times the long
prompts with the threads it then runs with (``lent_threads``): the Conductor predicts a prefill
at that speed while the host's other instances are idle. The result is cached per engine
signature (`LLMEngine.signature`: the configuration and the machine) and lent threads by
`profile_cache`, so only the first start of a configuration on a machine pays (seconds).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from yuebing.engine.engine import LLMEngine
from yuebing.engine.profile import _Tokens, time_decode, time_prefill, torch_threads
from yuebing.instance import profile_cache
from yuebing.protocol.instance import EngineProfile, Role

GRID_VERSION = 1
"""Part of the cache key: a new grid makes old cached profiles stale."""
PREFILL_NEW = (128, 512, 1536, 4096)
PREFILL_CACHED = (0, 1024)
LENT_NEW = (512, 1536, 4096)
"""Prompts (no cached prefix) timed again at the lent threads: the long ones, whose TTFT the
speed decides (a short prompt's fixed costs do not scale with threads)."""
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (512, 4096)


def cache_key(signature: dict[str, str], role: Role, lent_threads: int = 0) -> str:
    return profile_cache.cache_key(signature, role, GRID_VERSION, lent_threads)


def startup_profile(engine: LLMEngine, role: Role, cache: Path | None = None,
                    lent_threads: int = 0, fill_threads: int = 0) -> EngineProfile:
    """The cached profile of this engine's signature for ``role``, or a fresh one (cached; an
    unusable cache directory — read-only, no home — is logged and the profile measured anyway).
    ``lent_threads``: the threads a prefill step runs with on borrowed cores (0: none);
    ``fill_threads``: the threads of the untimed prefills that set a point up (0: own)."""
    signature = engine.signature()
    lent = lent_threads if role != Role.DECODE and lent_threads > torch.get_num_threads() else 0

    def fresh() -> EngineProfile:  # a grid cached without lending is reused: lent points only
        known = profile_cache.peek(signature, role, GRID_VERSION, cache) if lent else None
        return measure(engine, role, signature, lent, fill_threads, known)

    return profile_cache.cached_profile(signature, role, GRID_VERSION, fresh, cache, lent)


def measure(engine: LLMEngine, role: Role, signature: dict[str, str],
            lent_threads: int = 0, fill_threads: int = 0,
            known: EngineProfile | None = None) -> EngineProfile:
    """Time this role's grid on ``engine`` (points past its context or batch limits skipped);
    with ``lent_threads``, the `LENT_NEW` prompts again with that many threads. The untimed
    prefills that set a point up (a cached prefix, a decode batch's prompts) run with
    ``fill_threads``: the profile holds the host (`profile_cache`), and on a slow CPU they are
    most of its time. ``known``: this grid already measured (then only the lent points are)."""
    tokens = _Tokens(engine.model_config.vocab_size, seed=random.randrange(1 << 31))
    # fresh prompts on every call: another role's grid on the same engine must not hit them
    bs, limit = engine.block_size, engine.max_model_len
    engine.warmup()
    prefill: list[tuple[int, int, float]] = list(known.prefill) if known else []
    if role != Role.DECODE and known is None:
        for cached in PREFILL_CACHED:
            for new in PREFILL_NEW:
                if cached % bs == 0 and cached + new + 1 < limit:
                    t = time_prefill(engine, new, cached, tokens, fill_threads)
                    prefill.append((new, cached, t.wall))
    decode: list[tuple[int, int, float]] = list(known.decode) if known else []
    if role != Role.PREFILL and known is None:
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                if batch <= min(context, engine.config.max_num_seqs) \
                        and context // batch + 16 < limit:
                    decode.append((batch, context, time_decode(
                        engine, batch, context, tokens, fill_threads=fill_threads).wall))
    lent: list[tuple[int, int, float]] = []
    timed = {new for new, cached, _ in prefill if cached == 0}
    if lent_threads and prefill:
        with torch_threads(lent_threads):
            lent = [(new, 0, time_prefill(engine, new, 0, tokens).wall)
                    for new in LENT_NEW if new in timed]
    return EngineProfile(configuration=signature, prefill=prefill, decode=decode,
                         lent_threads=lent_threads if lent else 0, prefill_lent=lent)
