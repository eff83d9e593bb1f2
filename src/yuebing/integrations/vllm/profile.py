"""A vLLM server's start-up profile, which the Conductor fits its predictors to.

`run.run_vllm_instance` calls `vllm_profile` once its vLLM answers (``--startup-profile``, on by
default): roles that prefill time prompts of `PREFILL_NEW` new tokens after 0 and
`PREFILL_CACHED` tokens held in vLLM's prefix cache, roles that decode time steps of batches of
`DECODE_BATCHES` sequences, all through vLLM's OpenAI API. The result goes to the Conductor in
`Hello.profile`, keyed by `signature` (vLLM version, model, dtype, block size, accelerator,
threads and processor of a vLLM started here) and cached per signature and role by
`instance.profile_cache` beside yuebing's own engine profiles: only the first start of a
configuration on a machine pays.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import threading
import time
import urllib.request
from typing import Any

from yuebing.core.host import cpu_name
from yuebing.instance import profile_cache
from yuebing.protocol.instance import EngineProfile, Role

log = logging.getLogger(__name__)

GRID_VERSION = 1
"""Part of the cache key: a new grid makes old cached profiles stale."""
PREFILL_NEW = (128, 512, 1024, 2048)
PREFILL_CACHED = (0, 1024)
DECODE_BATCHES = (1, 4, 16)
DECODE_CONTEXTS = (512, 2048)
"""Context tokens of the whole batch (as yuebing's engine profile counts them)."""
DECODE_STEPS = 12
"""Tokens each sequence of a decode point generates (the steps between are timed)."""
DECODE_TAIL = 8
"""Fresh tokens at the end of each decode prompt (the rest is a shared base prompt)."""
TIMEOUT_S = 300.0
"""One request of the grid may take this long before the profile fails."""


def signature(version: str, model: str, dtype: str, block_size: int, layout: str,
              hardware: dict[str, str]) -> dict[str, str]:
    """The configuration a vLLM profile holds for (and `Hello.engine`): two vLLM servers with
    equal signatures take the same time per step. ``hardware`` is `started_hardware` or
    `given_hardware`."""
    return {"engine": "vllm", "vllm": version, "model": model, "dtype": dtype,
            "block_size": str(block_size), "kv": layout, **hardware}


def started_hardware(threads: int, lend_cores: int = 0) -> dict[str, str]:
    """What the vLLM-CPU server a ``yuebing vllm instance`` starts runs on: this processor,
    with ``threads`` OpenMP threads of its own (and borrowing among ``lend_cores``)."""
    if not lend_cores:
        return {"accelerator": "cpu", "threads": str(threads),
                "machine": f"{cpu_name()} | {threads} cores"}
    return {"accelerator": "cpu", "threads": str(threads), "lend_cores": str(lend_cores),
            "machine": f"{cpu_name()} | {threads} cores, lending among {lend_cores}"}


def given_hardware(accelerator: str) -> dict[str, str]:
    """What a vLLM at ``--vllm-url`` runs on, as its operator names it (``--accelerator``):
    neither this host's processor nor yuebing's ``--threads`` say anything about it."""
    return {"accelerator": accelerator, "machine": "given"}


def server_version(url: str) -> str:
    """vLLM's version (its ``/version``)."""
    with urllib.request.urlopen(url + "/version", timeout=10) as r:
        return str(json.loads(r.read())["version"])


class VllmProbe:
    """Timed requests to one vLLM server: `prefill` (seconds to a one-token answer) and
    `decode_step` (the median step of a batch decoding together)."""

    def __init__(self, url: str, model: str, vocab_size: int, seed: int | None = None) -> None:
        self.url, self.model = url, model
        self.rng = random.Random(seed if seed is not None else random.randrange(1 << 31))
        self.vocab = vocab_size
        self.bases: list[list[int]] = []
        """One base prompt per slot of a decode batch, shared by the decode points."""

    def tokens(self, n: int) -> list[int]:
        """``n`` fresh random token ids (every call: no prefix shared with another)."""
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    def _post(self, prompt: list[int], max_tokens: int, stream: bool) -> Any:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                           "stream": stream}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=TIMEOUT_S)

    def prefill(self, prompt: list[int]) -> float:
        """Seconds from sending ``prompt`` to vLLM's one-token answer."""
        t0 = time.perf_counter()
        with self._post(prompt, 1, stream=False) as r:
            r.read()
        return time.perf_counter() - t0

    def _stream_times(self, prompt: list[int], out: list[float]) -> None:
        with self._post(prompt, DECODE_STEPS, stream=True) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]" and \
                        json.loads(line[5:]).get("choices"):
                    out.append(time.perf_counter())

    def decode_prompt(self, length: int, slot: int = 0) -> list[int]:
        """A ``length``-token prompt for sequence ``slot`` of a decode point: the start of that
        slot's base prompt and `DECODE_TAIL` fresh tokens. The sequences of one batch have
        their own bases (a shared prefix would be KV read once for all, and the step too
        fast); the decode points share them (vLLM's prefix cache computes their blocks once)."""
        tail = min(DECODE_TAIL, length)
        while len(self.bases) <= slot:
            self.bases.append([])
        base = self.bases[slot]
        if len(base) < length - tail:
            base += self.tokens(length - tail - len(base))
        return base[:length - tail] + self.tokens(tail)

    def decode_step(self, batch: int, context: int) -> float:
        """The median step while ``batch`` sequences of ``context // batch`` prompt tokens
        each decode together: token gaps after the last sequence's first token and before
        the first sequence's last one."""
        times: list[list[float]] = [[] for _ in range(batch)]
        threads = [threading.Thread(target=self._stream_times,
                                    args=(self.decode_prompt(context // batch, i), times[i]))
                   for i in range(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(len(t) < 3 for t in times):
            raise RuntimeError(f"vLLM streamed too few tokens for the decode profile "
                               f"(batch {batch}): {[len(t) for t in times]}")
        start, end = max(t[0] for t in times), min(t[-1] for t in times)
        gaps = [b - a for t in times for a, b in zip(t, t[1:], strict=False)
                if a >= start and b <= end]
        if not gaps:  # the sequences never decoded side by side: the whole streams' gaps
            gaps = [b - a for t in times for a, b in zip(t[1:], t[2:], strict=False)]
        return statistics.median(gaps)


def measure(probe: VllmProbe, role: Role, sig: dict[str, str], max_model_len: int
            ) -> EngineProfile:
    """Time ``role``'s grid (points past ``max_model_len`` skipped)."""
    probe.prefill(probe.tokens(128))  # warm-up: the first request pays one-off costs
    prefill: list[tuple[int, int, float]] = []
    if role != Role.DECODE:
        for cached in PREFILL_CACHED:
            prefix = probe.tokens(cached)
            if cached:
                probe.prefill(prefix)  # now in vLLM's prefix cache
            for new in PREFILL_NEW:
                if cached + new + 1 < max_model_len:
                    prefill.append((new, cached, probe.prefill(prefix + probe.tokens(new))))
    decode: list[tuple[int, int, float]] = []
    if role != Role.PREFILL:
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                if context // batch + DECODE_STEPS < max_model_len:
                    decode.append((batch, context, probe.decode_step(batch, context)))
    return EngineProfile(configuration=sig, prefill=prefill, decode=decode)


def vllm_profile(probe: VllmProbe, role: Role, sig: dict[str, str], max_model_len: int
                 ) -> EngineProfile:
    """The profile cached for ``sig`` and ``role``, or one measured now (then cached)."""
    t0 = time.perf_counter()
    profile = profile_cache.cached_profile(
        sig, role, GRID_VERSION, lambda: measure(probe, role, sig, max_model_len))
    log.info("vLLM start-up profile (%s): %d prefill, %d decode points, %.1f s", role.name,
             len(profile.prefill), len(profile.decode), time.perf_counter() - t0)
    return profile
