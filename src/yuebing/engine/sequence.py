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
class StageInput:
    """A later pipeline stage's input for one sequence: the previous stage's `Boundary` rows
    of the prompt positions ``[start, available)``, as they arrive (`LLMEngine.feed`)."""

    start: int = -1
    """The first position received (-1: nothing yet)."""
    residual: list[torch.Tensor] = field(default_factory=list)
    x: list[torch.Tensor] = field(default_factory=list)
    available: int = 0
    """Prompt positions whose input has arrived (all below it)."""

    def rows(self, begin: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The input rows of positions ``[begin, begin + n)`` (all arrived)."""
        res, x = torch.cat(self.residual), torch.cat(self.x)
        self.residual, self.x = [res], [x]  # one tensor from here on
        lo = begin - self.start
        return res[lo:lo + n], x[lo:lo + n]


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
    staged: bool = False
    """Run by a pipeline stage: its prompt is only prefilled (every position, the last one
    too, in prefill chunks), and the last stage samples its first token and ends it."""
    stage_input: StageInput | None = None
    """On a later pipeline stage: the previous stage's output it computes from."""
    prefix_tokens: int | None = None
    """On a pipeline stage: use exactly this many cached prompt tokens (every stage of the
    group the same), else the longest cached prefix."""

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
    def num_ready(self) -> int:
        """Pending tokens that can run now (on a later stage: those whose input arrived)."""
        inp = self.stage_input
        if inp is None:
            return self.num_pending
        if inp.start < 0 or inp.start > self.num_computed:
            return 0  # nothing arrived, or not from where this stage's KV ends
        return max(0, inp.available - self.num_computed)

    @property
    def is_prefilling(self) -> bool:
        if self.staged:
            return self.num_computed < len(self.prompt_ids)
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
    boundary: tuple[int, torch.Tensor, torch.Tensor] | None = None
    """A pipeline stage before the last: (first position, residual rows, MLP output rows)
    of the prompt chunk this step computed, for the next stage (`LLMEngine.feed`)."""
