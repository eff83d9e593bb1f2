"""Sampling: per-request parameters (`SamplingParams`) and the batched sampler (`sample`).

`SamplingParams` arrive with each request and are validated there (bad values raise
`InputError` before anything is queued). After every model step the engine hands `sample` the
float32 logits of the rows that produce a token, with the stop tokens each may not pick yet
(``min_tokens``); greedy rows take the argmax, the others draw from the request's own generator
(`make_generator`), so other requests never shift a seeded request's draws. Its tokens are
batch-independent only if its logits are (``EngineConfig.batch_invariant``; docs/engine.md).
Logprobs (`batch_logprobs`) are of the raw float32 logits, as vLLM's default ``raw_logprobs``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import torch

from yuebing.core.errors import InputError

MAX_LOGPROBS = 20
MAX_N = 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the chosen token's logprob and this many top alternatives (0 = chosen only)."""
    n: int = 1
    """Choices sampled from the one prefill of the prompt: after it, the request forks into
    ``n`` sequences sharing the prompt's KV blocks; choice ``j`` draws with ``seed + j``."""
    min_tokens: int = 0
    """Until this many tokens were generated, stop ids and EOS (unless ``ignore_eos``) are
    masked out of sampling and stop strings are ignored."""

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise InputError(msg)

        check(isinstance(self.max_tokens, int) and self.max_tokens >= 0,
              f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        check(math.isfinite(self.temperature) and self.temperature >= 0,
              f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        n = self.n if isinstance(self.n, int) and self.n > 0 else 1
        check(self.seed is None or (isinstance(self.seed, int) and
                                    -2**63 <= self.seed <= 2**64 - n),
              f"seed must be an integer in {-2**63}..{2**64 - n} (choice j of n draws with "
              f"seed + j), got {self.seed!r}")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
              f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        check(isinstance(self.n, int) and 1 <= self.n <= MAX_N,
              f"n must be an integer in 1..{MAX_N}, got {self.n!r}")
        check(all(isinstance(s, str) and s for s in self.stop),
              f"stop strings must be non-empty strings, got {self.stop!r}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        check(0 <= self.min_tokens <= max(self.max_tokens, 0),
              f"min_tokens must be in 0..max_tokens, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def choice(self, j: int) -> SamplingParams:
        """The parameters of choice ``j`` of an ``n > 1`` request (its own seed stream)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + j)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's logprob and the most likely tokens of its step, best first."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """Per row, or None where the row asked for none."""


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p on one row of logits (returns a new tensor)."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = (cum - probs) >= p.top_p  # keep the smallest set whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           banned: Sequence[Collection[int]] | None = None) -> SampleResult:
    """One token per row of ``logits [B, vocab]`` (float32, on CPU or the model's device);
    ``banned[row]``: token ids that row may not pick (their logits count as -inf)."""
    raw = logits = logits.float()
    if banned is not None and any(banned):
        logits = logits.clone()
        vocab = logits.shape[-1]
        for row, ids in enumerate(banned):
            cols = [t for t in ids if t < vocab]
            if cols:
                logits[row, cols] = float("-inf")
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    tokens: list[int] = []
    for row, p in enumerate(params):
        if p.greedy:
            tokens.append(int(greedy_ids[row]))
            continue
        probs = torch.softmax(_filter(logits[row], p), dim=-1)
        gen = generators[row]
        tok = torch.multinomial(probs.cpu(), 1, generator=gen) if gen is not None else \
            torch.multinomial(probs.cpu(), 1)
        tokens.append(int(tok))
    return SampleResult(tokens, batch_logprobs(raw, tokens, params))


def batch_logprobs(raw: torch.Tensor, tokens: list[int],
                   params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Logprobs of the rows of ``raw [B, vocab]`` that ask for them: tensor ops over those
    rows together, then one copy of the results to the host."""
    want = [r for r, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not want:
        return out
    k = max(params[r].logprobs or 0 for r in want)
    rows = torch.as_tensor(want, device=raw.device)
    lp = torch.log_softmax(raw.index_select(0, rows).float(), dim=-1)
    chosen = lp.gather(1, torch.as_tensor([tokens[r] for r in want],
                                          device=raw.device)[:, None])
    top_v, top_i = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0])
    host = torch.cat([chosen, top_v, top_i.to(lp.dtype)], 1).double().cpu().tolist()
    for i, r in enumerate(want):
        kr = params[r].logprobs or 0
        row = host[i]
        out[r] = TokenLogprobs(row[0], [int(t) for t in row[1 + k:1 + k + kr]], row[1:1 + kr])
    return out


def make_generator(p: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded from ``p.seed`` (None = the global RNG)."""
    if p.seed is None or p.greedy:
        return None
    return torch.Generator().manual_seed(p.seed)
