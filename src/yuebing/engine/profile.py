"""Profiling the engine for the latency predictors (``yuebing profile``): `profile_engine`.

On a live `LLMEngine` it times prefill (`time_prefill`: from queueing ``cached + new`` tokens,
the first ``cached`` already in the prefix cache, to the first token, over a grid of (new,
cached); `time_chunks`: each chunk of one long prompt as the engine prefills it), decode (`time_decode`: one step of ``batch`` sequences, ``context`` tokens in all)
and, with ``--interference`` (`yuebing.engine.interference`), each phase's slowdown while a
neighbour engine runs the other. Results are `ProfileSamples`, saved as JSON (format
``yuebing-profile-samples`` v1, docs/engine.md) and fitted by the CLI with
`yuebing.conductor.policy.predictors`. Fresh random tokens keep other prefixes out of the cache.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import msgspec
import torch

from yuebing.core.errors import InputError
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams

SAMPLES_FORMAT = "yuebing-profile-samples"
log = logging.getLogger(__name__)
_ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


class PrefillSample(msgspec.Struct):
    new_tokens: int
    cached_tokens: int
    seconds: float


class DecodeSample(msgspec.Struct):
    batch: int
    context_tokens: int
    seconds: float


class InterferenceSample(msgspec.Struct):
    """One point: ``phase`` ("decode" or "prefill") timed alone and with the neighbour running
    the other phase; ``size`` is [batch, context tokens] or [new, cached tokens]."""

    phase: str
    size: list[int]
    alone_s: float
    shared_s: float


class Interference(msgspec.Struct):
    """Slowdown factors of one phase while the host-mate runs the other (≥ 1 when they slow
    each other down), with the points they come from."""

    decode_factor: float
    prefill_factor: float
    samples: list[InterferenceSample]
    neighbour: str = ""


class ProfileSamples(msgspec.Struct):
    """Raw measurements (seconds are medians over repeats)."""

    format: str
    version: int
    model: str
    device: str
    dtype: str
    threads: int
    block_size: int
    prefill: list[PrefillSample]
    decode: list[DecodeSample]
    interference: Interference | None = None
    """``yuebing profile --interference`` only (`yuebing.engine.interference`); absent in
    files written without it, which stay valid v1 files."""

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2)

    @classmethod
    def from_json(cls, data: bytes | str, origin: str = "<samples>") -> ProfileSamples:
        try:
            doc = msgspec.json.decode(data, type=cls)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise InputError(f"{origin}: invalid profile samples: {e}") from None
        if doc.format != SAMPLES_FORMAT or doc.version != 1:
            raise InputError(f"{origin}: not a {SAMPLES_FORMAT} v1 file")
        return doc


class _Tokens:
    """Fresh random token ids (avoiding accidental prefix-cache hits)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()


def _until_first_token(engine: LLMEngine, rid: str) -> int:
    while True:
        for out in engine.step():
            if out.request_id == rid:
                return out.num_cached_tokens


class Timing(NamedTuple):
    """Wall seconds, and CPU seconds of this process over the same interval (steadier than
    wall time on a CPU shared with other busy processes when running one thread)."""

    wall: float
    cpu: float


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> Timing:
    return Timing(time.perf_counter() - start[0], time.process_time() - start[1])


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads (0: as they are), then restore them."""
    own = torch.get_num_threads()
    if n and n != own:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != own:
            torch.set_num_threads(own)


def time_prefill(engine: LLMEngine, new: int, cached: int, tokens: _Tokens,
                 fill_threads: int = 0) -> Timing:
    """Time to first token for ``new`` tokens on top of ``cached`` cached ones (the untimed
    prefill of the cached ones with ``fill_threads``, 0 = the engine's own)."""
    bs = engine.block_size
    if cached % bs:
        raise InputError(f"cached tokens ({cached}) must be a multiple of the block size {bs}")
    prompt = tokens(cached + new)
    if cached:
        with torch_threads(fill_threads):
            engine.generate([prompt[:cached + 1]], _ONE)  # publishes the cached full blocks
    t0 = _clocks()
    rid = engine.add_request(prompt, _ONE)
    hit = _until_first_token(engine, rid)
    seconds = _since(t0)
    if hit != cached:
        raise InputError(f"expected {cached} cached tokens, the engine reused {hit}; is the "
                         "KV pool large enough and prefix caching on?")
    return seconds


def time_chunks(engine: LLMEngine, n: int, tokens: _Tokens) -> list[tuple[int, int, float]]:
    """(new, cached, seconds) of each step of one ``n``-token prompt's prefill: chunks of
    ``max_batch_tokens``, each on top of the ones before (what a long prefill, e.g. a CPP
    stage's, costs chunk by chunk)."""
    rid = engine.add_request(tokens(n), _ONE)
    out: list[tuple[int, int, float]] = []
    done = False
    while not done:
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        plan = engine.last_plan
        for seq, k in plan.prefills if plan is not None else ():
            if seq.request_id == rid:  # its chunk is in; what it attended over before it
                out.append((k, seq.num_computed - k, dt))
        done = any(o.request_id == rid for o in outs)
    return out


def start_decoding(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int,
                   tokens: Callable[[int], list[int]]) -> list[str]:
    """Add ``batch`` greedy requests of ``prompt_len`` tokens and step the engine until every
    one has finished its prefill, so the next steps are pure decode steps; returns their ids."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rids = [engine.add_request(tokens(prompt_len), params) for _ in range(batch)]

    def prefilling(rid: str) -> bool:
        seq = engine.get_sequence(rid)
        return seq is not None and (seq.num_computed == 0 or seq.is_prefilling)

    while any(prefilling(r) for r in rids):
        engine.step()
    return rids


def interleaved_decode(engines: dict[str, LLMEngine], batch: int, prompt_len: int, steps: int,
                       tokens: _Tokens) -> dict[str, dict[str, float]]:
    """Decode ``steps`` steps of ``batch`` same-prompt sequences in every engine, the engines'
    steps interleaved (A, B, A, B, ...) so load from other processes hits them alike; returns
    per engine the median wall and process-CPU ms per step. Used by the side-by-side engine
    benchmarks in ``benchmarks/`` (engine_hotpath.py, engine_kernels.py)."""
    prompts = [tokens(prompt_len) for _ in range(batch)]

    def replay() -> Callable[[int], list[int]]:  # the same prompts, in order, for each engine
        it = iter(prompts)
        return lambda _n: next(it)

    rids = {k: start_decoding(e, batch, prompt_len, steps + 4, replay())
            for k, e in engines.items()}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in engines}
    for _ in range(steps):
        for k, e in engines.items():
            w0, c0 = time.perf_counter(), time.process_time()
            e.step()
            samples[k].append((time.perf_counter() - w0, time.process_time() - c0))
    for k, e in engines.items():
        for r in rids[k]:
            e.abort(r)
    return {k: {"wall_ms": 1e3 * statistics.median(s[0] for s in v),
                "cpu_ms": 1e3 * statistics.median(s[1] for s in v)} for k, v in samples.items()}


def time_decode(engine: LLMEngine, batch: int, context: int, tokens: _Tokens,
                steps: int = 8, fill_threads: int = 0) -> Timing:
    """Median time of a decode step with ``batch`` sequences, ``context`` tokens in all (the
    untimed prefill of their prompts with ``fill_threads``, 0 = the engine's own)."""
    if batch > engine.config.max_num_seqs:
        raise InputError(f"decode batch {batch} exceeds max_num_seqs "
                         f"({engine.config.max_num_seqs}); raise --max-num-seqs")
    per_seq = max(1, context // batch - steps // 2)
    with torch_threads(fill_threads):
        rids = start_decoding(engine, batch, per_seq, steps + 1, tokens)
    times = []
    for _ in range(steps):
        t0 = _clocks()
        engine.step()
        times.append(_since(t0))
    for r in rids:
        engine.abort(r)
    return median_timing(times)


def median_timing(times: Iterable[Timing]) -> Timing:
    ts = list(times)
    return Timing(statistics.median(t.wall for t in ts), statistics.median(t.cpu for t in ts))


def profile_engine(engine: LLMEngine, new_tokens: Iterable[int], cached_tokens: Iterable[int],
                   batches: Iterable[int], contexts: Iterable[int], repeats: int = 3,
                   progress: Callable[[str], None] | None = None,
                   long_prompt: int = 0) -> ProfileSamples:
    """Measure the whole grid, each point the median of ``repeats`` measurements (a decode
    measurement: the median of 8 steps), and with ``long_prompt`` the chunks of such a prompt
    (`time_chunks`, each the median of ``repeats`` prompts); ``progress(label)`` is called
    before each point."""
    tokens = _Tokens(engine.model_config.vocab_size)
    engine.warmup()
    prefill: list[PrefillSample] = []
    for n in new_tokens:
        for c in cached_tokens:
            if c + n >= engine.max_model_len:
                log.warning("skipping prefill new=%s cached=%s: over the context of %s tokens",
                            n, c, engine.max_model_len)
                continue
            if progress:
                progress(f"prefill new={n} cached={c}")
            t = statistics.median(time_prefill(engine, n, c, tokens).wall
                                  for _ in range(repeats))
            prefill.append(PrefillSample(n, c, t))
    if long_prompt:
        if long_prompt >= engine.max_model_len:
            raise InputError(f"--long-prompt {long_prompt} does not fit the model's context "
                             f"of {engine.max_model_len} tokens")
        if progress:
            progress(f"prefill chunks of a {long_prompt}-token prompt")
        runs = [time_chunks(engine, long_prompt, tokens) for _ in range(repeats)]
        for chunk in zip(*runs, strict=True):
            prefill.append(PrefillSample(chunk[0][0], chunk[0][1],
                                         statistics.median(s for _, _, s in chunk)))
    decode: list[DecodeSample] = []
    for b in batches:
        for ctx in contexts:
            if ctx < b or ctx // b + 16 >= engine.max_model_len:
                log.warning("skipping decode batch=%s context=%s: needs batch <= context "
                            "< batch * %s", b, ctx, engine.max_model_len - 16)
                continue
            if progress:
                progress(f"decode batch={b} context={ctx}")
            t = statistics.median(time_decode(engine, b, ctx, tokens).wall
                                  for _ in range(repeats))
            decode.append(DecodeSample(b, ctx, t))
    return ProfileSamples(SAMPLES_FORMAT, 1, engine.fingerprint, str(engine.device),
                          str(engine.dtype).removeprefix("torch."), torch.get_num_threads(),
                          engine.block_size, prefill, decode)
