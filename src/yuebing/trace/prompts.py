"""Prompt synthesis: token ids that realize a trace's ``hash_ids`` sharing, for live benchmarks.

Block j of a request is filled with tokens that depend only on (seed, hash_ids[j], position):
equal ids give equal blocks and different ids different ones, so block keys over the tokens
(`yuebing.core.hash_blocks`) agree exactly where the trace's ids do. Tokens no id covers are
unique to the request (a caller's ``salt``, by default its index). A SplitMix64 counter hash in
numpy (identical on every platform) maps them into [low, high), avoiding special tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from yuebing.core.config import require
from yuebing.trace.model import Request, Trace

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SALT_SPACE = np.uint64(0xA5A5_0000_0000_0000)
"""Keeps salted (uncovered) blocks apart from hash-id blocks."""


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finalizer applied elementwise to a uint64 array (wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class PromptSynthesizer:
    """Deterministic token ids for trace requests."""

    low: int = field(default=1000, metadata={"help": "smallest token id to use"})
    high: int = field(default=30000, metadata={"help": "one past the largest token id to use"})
    seed: int = field(default=0, metadata={"help": "changes every token (not the sharing)"})
    block_size: int = field(default=512, metadata={"help": "tokens per block"})

    def __post_init__(self) -> None:
        require(0 <= self.low < self.high,
                f"need 0 <= low < high for the token range, got [{self.low}, {self.high})")
        require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")

    def _tokens(self, keys: np.ndarray) -> np.ndarray:
        """[len(keys), block_size] tokens; row i depends only on (seed, keys[i])."""
        bs = np.uint64(self.block_size)
        with np.errstate(over="ignore"):
            base = splitmix64(keys.astype(np.uint64) ^ splitmix64(
                np.array([self.seed], dtype=np.uint64)))
            counters = base[:, None] * bs + np.arange(self.block_size, dtype=np.uint64)[None, :]
        span = np.uint64(self.high - self.low)
        return (splitmix64(counters) % span).astype(np.int64) + self.low

    def block(self, hash_id: int) -> list[int]:
        """The full block of tokens that ``hash_id`` stands for."""
        return self._tokens(np.array([hash_id], dtype=np.uint64))[0].tolist()

    def tokens(self, request: Request, salt: int = 0) -> list[int]:
        """The prompt of ``request``: exactly ``input_length`` token ids."""
        n, bs = request.input_length, self.block_size
        covered = min(len(request.hash_ids), -(-n // bs))
        extra = -(-n // bs) - covered
        keys = np.array(request.hash_ids[:covered], dtype=np.uint64)
        if extra:
            with np.errstate(over="ignore"):
                salted = _SALT_SPACE ^ (splitmix64(np.array([salt], dtype=np.uint64))
                                        + np.arange(extra, dtype=np.uint64))
            keys = np.concatenate([keys, salted])
        if not len(keys):
            return []
        return self._tokens(keys).reshape(-1)[:n].tolist()

    def prompts(self, trace: Trace) -> Iterator[list[int]]:
        """Prompts of a trace in its order, each salted with its index."""
        for i, r in enumerate(trace.requests):
            yield self.tokens(r, salt=i)
