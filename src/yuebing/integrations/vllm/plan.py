"""`RequestPlan`: the scheduler half's bookkeeping of one request — which of its vLLM blocks
load from which store objects (`LoadJob`) and which full store blocks are saved when
(`SaveJob`). Pure: `scheduler.SchedulerSide` keeps one per request and hands the jobs to the
worker half (`worker.WorkerSide`) in the step's connector metadata.

Only prompt tokens are stored, and only whole store blocks (``layout.store_block_tokens``). A
load covers whole vLLM blocks, leaves at least the prompt's last token to compute (vLLM needs
one to sample from) and starts after vLLM's own prefix-cache hit (``num_computed``).
"""

from __future__ import annotations

from dataclasses import dataclass

from yuebing.integrations.vllm.layout import KvLayout


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

    def matched_tokens(self, stored: int, num_computed: int) -> int:
        """Tokens loadable from the store beyond vLLM's own ``num_computed``, given that the
        store holds the first ``stored`` objects."""
        self.stored = stored
        self.num_computed = num_computed
        b = self.layout.block_tokens
        limit = min(stored * self.layout.store_block_tokens, (self.prompt_len - 1) // b * b)
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
