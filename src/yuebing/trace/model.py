"""The trace data model: one `Request` per JSONL line, a `Trace` holding them in file order.

A Mooncake trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [block ids]}``. ``hash_ids[j]`` names the KV block holding prompt tokens
``[j*512, (j+1)*512)``, and is *chained*: equal ids at position j mean equal prompts up to and
including block j. The last block may be partial (``input_length`` need not be a multiple of
512). `Request` is a frozen msgspec struct so decoding straight into it is both the parser and
the type check (`yuebing.trace.io`); every transform returns a new `Trace`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import msgspec

BLOCK_SIZE = 512
"""Tokens per KV block in the released Mooncake traces."""

MAX_TIMESTAMP_MS = 10**15
"""Latest arrival a trace may hold (about 31,700 years in ms): sums and numpy int64 stay exact."""
MAX_TOKENS = 2**31 - 1
"""Most prompt or output tokens of one request (far beyond any model's context)."""
MAX_BLOCK_ID = 2**63 - 1
"""Largest block id (they are handled as int64)."""

Timestamp = Annotated[int, msgspec.Meta(ge=0, le=MAX_TIMESTAMP_MS)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]


class Request(msgspec.Struct, frozen=True):
    """One request of a trace: arrival time, prompt and output lengths, prompt block ids."""

    timestamp: Timestamp
    """Arrival time in milliseconds since the trace start."""
    input_length: Tokens
    """Prompt tokens."""
    output_length: Tokens
    """Generated tokens."""
    hash_ids: tuple[BlockId, ...]
    """Chained ids of the prompt's blocks (at most ceil(input_length / block size))."""


def blocks_needed(input_length: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks covering ``input_length`` tokens, the last one possibly partial: ceil(n / size)."""
    return -(-input_length // block_size)


@dataclass(frozen=True)
class Trace:
    """An immutable sequence of requests in file order (not necessarily sorted by time)."""

    requests: tuple[Request, ...]
    block_size: int = BLOCK_SIZE
    source: str = field(default="<memory>", compare=False)
    """Where the requests came from (a path, or a generator description)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def __len__(self) -> int:
        return len(self.requests)

    def in_time_order(self) -> list[Request]:
        """Requests sorted by timestamp; equal timestamps keep file order (stable sort)."""
        return sorted(self.requests, key=lambda r: r.timestamp)

    def with_requests(self, requests: tuple[Request, ...] | list[Request], source: str) -> Trace:
        """A new trace with the same block size and other requests."""
        return Trace(tuple(requests), self.block_size, source)
