"""The requests a bench run sends (`yuebing bench serve`): prompts, output lengths and send
times from a loaded or generated trace, all built before anything is sent.

`build_workload` takes the first ``limit`` requests in arrival order, makes each hash block
``block_tokens`` prompt tokens (cut to ``max_input``, a prefix, so sharing stays exact), caps
the output, fills the blocks with `trace.PromptSynthesizer` token ids (equal ``hash_ids`` →
equal blocks; text prompts decode them with ``--tokenizer``) and sets send times (the trace's
over ``speed``, or seeded Poisson at ``rate``). `sweep_workloads` builds one per rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from yuebing.bench.config import BenchConfig
from yuebing.core.errors import InputError
from yuebing.trace.model import Request, Trace
from yuebing.trace.prompts import PromptSynthesizer
from yuebing.trace.transform import poisson_arrivals


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send."""

    index: int
    """Position in arrival order (0-based), also the prompt's salt."""
    send_s: float
    """Scheduled send time, seconds after the run's start (open loop)."""
    prompt: tuple[int, ...] | str
    """Token ids, or text for ``--prompt-format text``."""
    input_tokens: int
    """Prompt tokens as synthesized (the server's own count is in the result's usage)."""
    max_tokens: int
    """Output tokens to ask for."""


def scaled_request(r: Request, block_size: int, cfg: BenchConfig) -> Request:
    """``r`` with ``cfg.block_tokens`` tokens per hash block, the caps applied."""
    n = -(-r.input_length * cfg.block_tokens // block_size)
    if cfg.max_input:
        n = min(n, cfg.max_input)
    blocks = -(-n // cfg.block_tokens)
    out = r.output_length if not cfg.max_output else min(r.output_length, cfg.max_output)
    return Request(r.timestamp, n, max(out, 1), r.hash_ids[:blocks])


def send_times(requests: Sequence[Request], cfg: BenchConfig, rate: float | None) -> list[float]:
    """Seconds after the first send: Poisson at ``rate`` if given, else timestamps / speed."""
    if rate is not None:
        return [t / 1000.0 for t in poisson_arrivals(len(requests), rate, cfg.seed)]
    t0 = requests[0].timestamp if requests else 0
    return [(r.timestamp - t0) / 1000.0 / cfg.speed for r in requests]


def load_detokenizer(path: str) -> Callable[[Sequence[int]], str]:
    """A function decoding token ids to text with the tokenizer.json at ``path``."""
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise InputError(f"--tokenizer {path!r}: no such file")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise InputError(f"--tokenizer {path!r} is not a tokenizer.json: {e}") from None
    vocab = tok.get_vocab_size()

    def decode(ids: Sequence[int]) -> str:
        if ids and max(ids) >= vocab:
            raise InputError(f"--tokenizer {path!r} has {vocab} tokens but prompts use ids up "
                             f"to {max(ids)}; lower --prompt-high")
        return str(tok.decode(list(ids)))

    return decode


def build_workload(trace: Trace, cfg: BenchConfig,
                   synth: PromptSynthesizer | None = None) -> list[BenchRequest]:
    """The requests of ``trace`` under ``cfg`` (``synth`` gives the token-id range and seed;
    its block size is ``cfg.block_tokens``).

    Raises `InputError` when nothing is left to send or a prompt would be empty.
    """
    rate = cfg.rate or None
    chosen = trace.in_time_order()[: cfg.limit or None]
    if not chosen:
        raise InputError(f"{trace.source}: no requests to send")
    base = synth or PromptSynthesizer()
    prompts = PromptSynthesizer(base.low, base.high, base.seed, cfg.block_tokens)
    decode = load_detokenizer(cfg.tokenizer) if cfg.prompt_format == "text" else None
    reqs = [scaled_request(r, trace.block_size, cfg) for r in chosen]
    out = []
    for i, (r, t) in enumerate(zip(reqs, send_times(reqs, cfg, rate), strict=True)):
        if r.input_length == 0:
            raise InputError(f"{trace.source}: request {i} (timestamp {r.timestamp} ms) has an "
                             "empty prompt; filter it out (yuebing trace filter --min-input 1)")
        ids = tuple(prompts.tokens(r, salt=i))
        prompt: tuple[int, ...] | str = ids if decode is None else decode(ids)
        out.append(BenchRequest(i, t, prompt, r.input_length, r.output_length))
    return out


def sweep_workloads(trace: Trace, cfg: BenchConfig, synth: PromptSynthesizer | None,
                    rates: Sequence[float]) -> list[tuple[float, list[BenchRequest]]]:
    """One workload per rate (Poisson at that rate). Run k's prompts use prompt seed
    ``seed + k``: the same lengths and sharing, other tokens, so no run finds the previous
    runs' prompts in the server's prefix cache."""
    base = synth or PromptSynthesizer()
    return [(rate, build_workload(trace, replace(cfg, rate=rate),
                                  replace(base, seed=base.seed + k)))
            for k, rate in enumerate(rates)]
