"""A request inside the engine: its tokens, KV blocks, phase and outputs.

Life cycle: `add_request` creates a `Sequence` in ``WAITING``; the scheduler admits it
(``RUNNING``), its prompt is prefilled in one or more chunks, then it decodes one token per
step until a stop condition (``FINISHED``). When KV runs out it may be preempted back to
``WAITING`` (its blocks are freed and its tokens recomputed later). ``ABORTED`` ends it early.
A request with ``n > 1`` forks after its prefill into ``n`` sequences (choice ``index`` 0..n-1,
one ``group``: the request id) that share the prompt's KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

from yuebing.core.ids import BlockHash
from yuebing.engine.sampling import SamplingParams, TokenLogprobs


class Phase(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    ABORTED = 3


class FinishReason(IntEnum):
    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3

    @property
    def label(self) -> str | None:
        return {1: "stop", 2: "length", 3: "abort"}.get(int(self))


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    finish: FinishReason = FinishReason.NONE
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose K/V is in ``blocks``."""
    keys: list[BlockHash] = field(default_factory=list)
    """Chained keys of the full blocks published so far."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache or imported, at admission."""
    generator: torch.Generator | None = None
    detok: object | None = None
    text: str = ""
    emitted: int = 0
    """Characters of ``text`` already streamed (the tail may be held back for stop strings)."""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    preemptions: int = 0
    hold_kv: bool = False
    """Keep the blocks allocated after finishing, until `LLMEngine.release`."""
    group: str = ""
    """The request id its outputs carry: its own, or for a forked choice its request's."""
    index: int = 0
    """Its choice among the request's ``n`` (0: the sequence that prefilled)."""

    def __post_init__(self) -> None:
        self.group = self.group or self.request_id

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens that still need a forward pass (1 when decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending > 1

    @property
    def done(self) -> bool:
        return self.phase >= Phase.FINISHED


@dataclass
class RequestOutput:
    """What one step produced for one request (streamed to the caller)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    output_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    index: int = 0
    """The choice (n > 1) this output belongs to; ``finished``: that choice ended."""
    done: bool = True
    """The whole request ended (every choice finished); meaningful when ``finished``."""
