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

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class Request(msgspec.Struct, frozen=True):
    """One request of a trace: arrival time, prompt and output lengths, prompt block ids."""

    timestamp: NonNegInt
    """Arrival time in milliseconds since the trace start."""
    input_length: NonNegInt
    """Prompt tokens."""
    output_length: NonNegInt
    """Generated tokens."""
    hash_ids: tuple[NonNegInt, ...]
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
