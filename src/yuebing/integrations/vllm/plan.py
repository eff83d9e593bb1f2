"""`RequestPlan`: the scheduler half's bookkeeping of one request — which of its vLLM blocks
load from which store objects (`LoadJob`) and which full store blocks are saved when
(`SaveJob`). Pure: `scheduler.SchedulerSide` keeps one per request and hands the jobs to the
worker half (`worker.WorkerSide`) in the step's connector metadata.

Only whole store blocks of prompt tokens are stored. A load covers whole vLLM blocks, starts
after vLLM's own prefix-cache hit and leaves at least the prompt's last token to compute. A
layer-wise hand-off (`StreamParams`): a prefill also sends each step's blocks (`send_job`); its
decode reads the whole prompt's KV from the pool (`recv_job`) in place of the store load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from yuebing.integrations.vllm.layout import KvLayout
from yuebing.integrations.vllm.stream import StreamJob

SEND_KEY = "yuebing_send"
RECV_KEY = "yuebing_recv"


@dataclass(frozen=True)
class LoadJob:
    """Store objects ``keys`` (a leading run from the request's first not-computed store
    block) read into vLLM blocks: ``blocks`` = (object index in ``keys``, vLLM block within
    the object, vLLM block id)."""

    req_id: str
    keys: tuple[str, ...]
    blocks: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class SaveJob:
    """One full store block computed in this step: its key and its vLLM blocks, in order."""

    req_id: str
    key: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StreamParams:
    """A layer-wise hand-off of one request, as its ``kv_transfer_params`` carry it: the
    decode's receive pool (``segment``, ``num_blocks`` in all) and the request's blocks there,
    one per vLLM block of the prompt (``tokens`` tokens)."""

    handoff_id: str
    segment: str
    num_blocks: int
    pool_blocks: tuple[int, ...]
    tokens: int
    expires_at_s: float = 0.0
    """Send: the decode's reservation expires then (time.time()); 0 = never."""

    def to_params(self) -> dict[str, Any]:
        return {"id": self.handoff_id, "segment": self.segment, "num_blocks": self.num_blocks,
                "blocks": list(self.pool_blocks), "tokens": self.tokens,
                "expires_at_s": self.expires_at_s}

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None, key: str) -> StreamParams | None:
        """``params[key]`` as `StreamParams`; None when absent (ValueError when malformed)."""
        raw = (params or {}).get(key)
        if raw is None:
            return None
        try:
            out = cls(str(raw["id"]), str(raw["segment"]), int(raw["num_blocks"]),
                      tuple(int(b) for b in raw["blocks"]), int(raw["tokens"]),
                      float(raw.get("expires_at_s", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad {key} in kv_transfer_params: {raw!r} ({e})") from None
        if not out.segment or out.tokens <= 0 or not out.pool_blocks or any(
                not 0 <= b < out.num_blocks for b in out.pool_blocks):
            raise ValueError(f"bad {key} in kv_transfer_params: {raw!r}")
        return out


class RequestPlan:
    """One request's store keys, what the store holds of them, its vLLM block ids so far and
    how far its saves got."""

    def __init__(self, req_id: str, keys: list[str], prompt_len: int, layout: KvLayout) -> None:
        self.req_id = req_id
        self.keys = keys
        self.prompt_len = prompt_len
        self.layout = layout
        self.stored = 0
        """Leading store objects the store held at the last lookup."""
        self.saved = 0
        """Leading store objects saved (or held by the store) so far."""
        self.block_ids: list[int] = []
        self.load: tuple[int, int] | None = None
        """Token range [start, end) to load in the request's next scheduled step."""
        self.num_computed = 0
        """vLLM's own (block-aligned) prefix-cache hit at the last lookup."""
        self.send: StreamParams | None = None
        self.recv: StreamParams | None = None
        self.sent = 0
        """Send: leading vLLM blocks of the request sent whole (a partial one goes again)."""

    def matched_tokens(self, stored: int, num_computed: int) -> int:
        """Tokens loadable from the store beyond vLLM's own ``num_computed``, given that the
        store holds the first ``stored`` objects."""
        self.stored = stored
        self.num_computed = num_computed
        b = self.layout.block_tokens
        limit = min(stored * self.layout.store_block_tokens, (self.prompt_len - 1) // b * b)
        return max(0, limit - num_computed)

    def recv_tokens(self, num_computed: int) -> int:
        """Recv: tokens the decode's pool gives beyond vLLM's ``num_computed`` (the whole
        prompt the prefill computed; at least one token is left to compute)."""
        assert self.recv is not None
        self.num_computed = num_computed
        self.stored = self.saved = len(self.keys)  # the prefill saves the prompt's blocks
        limit = min(self.recv.tokens, self.prompt_len - 1,
                    len(self.recv.pool_blocks) * self.layout.block_tokens)
        return max(0, limit - num_computed)

    def allocated(self, block_ids: list[int], num_external: int) -> None:
        """vLLM gave the request its blocks; ``num_external`` tokens after its prefix-cache
        hit (``num_computed`` at the lookup) are to be loaded."""
        self.block_ids = list(block_ids)
        start = self.num_computed
        self.load = (start, start + num_external) if num_external > 0 else None

    def add_blocks(self, block_ids: list[int], replace: bool = False) -> None:
        self.block_ids = list(block_ids) if replace else self.block_ids + list(block_ids)

    def load_job(self) -> LoadJob | None:
        """The pending load as a job (once; None if none is pending)."""
        if self.load is None:
            return None
        start, end = self.load
        self.load = None
        b, k = self.layout.block_tokens, self.layout.blocks_per_object
        first_obj = start // b // k
        blocks = tuple(((vb // k) - first_obj, vb % k, self.block_ids[vb])
                       for vb in range(start // b, end // b))
        last_obj = (end // b - 1) // k
        return LoadJob(self.req_id, tuple(self.keys[first_obj:last_obj + 1]), blocks)

    def recv_job(self) -> StreamJob | None:
        """Recv: the pending load as a read of the decode's pool (once)."""
        if self.load is None or self.recv is None:
            return None
        start, end = self.load
        self.load = None
        b = self.layout.block_tokens
        first, stop = start // b, -(-end // b)
        r = self.recv
        return StreamJob(self.req_id, r.handoff_id, r.segment, r.num_blocks,
                         tuple(self.block_ids[first:stop]), r.pool_blocks[first:stop])

    def send_job(self, end_tokens: int) -> StreamJob | None:
        """Send: this step's blocks (from the first not sent whole up to the one holding
        token ``end_tokens - 1``) for the decode's pool; ``last`` once the prompt is done."""
        s = self.send
        if s is None:
            return None
        b = self.layout.block_tokens
        end = min(end_tokens, self.prompt_len, len(s.pool_blocks) * b)
        stop = min(-(-end // b), len(self.block_ids))
        first = self.sent
        self.sent = end // b
        last = end_tokens >= self.prompt_len
        if last:
            self.send = None
        return StreamJob(self.req_id, s.handoff_id, s.segment, s.num_blocks,
                         tuple(self.block_ids[first:stop]), s.pool_blocks[first:stop], last,
                         s.expires_at_s)

    def save_jobs(self, end_tokens: int) -> list[SaveJob]:
        """Store blocks that are full once ``end_tokens`` tokens are computed and not saved
        yet (nor held by the store)."""
        k = self.layout.blocks_per_object
        full = min(end_tokens, self.prompt_len) // self.layout.store_block_tokens
        full = min(full, len(self.keys), len(self.block_ids) // k)
        start = max(self.saved, self.stored)
        jobs = [SaveJob(self.req_id, self.keys[j], tuple(self.block_ids[j * k:(j + 1) * k]))
                for j in range(start, full)]
        self.saved = max(self.saved, full)
        return jobs
