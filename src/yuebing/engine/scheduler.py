"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption: `Scheduler`.

The engine calls `schedule` at the start of every step. Within the token budget
(``max_batch_tokens``; beside running decodes at most what `MixedBudget` allows, so a mixed
step stays within ``mixed_step_s``) every running decoding sequence gets one token, then
prefilling sequences get prompt chunks: those already started first, then new ones admitted from the
waiting queue (FIFO, up to ``max_num_seqs`` running) after a prefix-cache lookup; one admitted
with a single token left (its KV imported) joins the decodes instead. With
``mixed_batches`` off a step is all prefill or all decode (prefill first). When no KV block is
free the newest running sequence is preempted (`preempt`) and later recomputed. After the
forward pass the engine calls `commit`, and `free` for finished or aborted sequences.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from yuebing.core.hashing import hash_block, hash_blocks
from yuebing.core.ids import BlockHash
from yuebing.engine.block_manager import BlockAllocator
from yuebing.engine.sequence import Phase, Sequence

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """What one step computes: decoding sequences, then (sequence, new tokens) chunks."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    joined: list[Sequence] = field(default_factory=list)
    """Decodes admitted this step from the waiting queue with one token left (KV imported:
    a decode instance's new request), already in ``decodes``."""

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class MixedBudget:
    """The tokens a step may hold beside running decodes so that it lasts at most ``target_s``
    (Sarathi-style stall-free batching): ``target_s`` over the seconds per token of recent mixed
    steps (a prefill chunk beside decodes; an average that follows the host's speed and the
    context). A step's fixed part (the weights' read) counted per token overstates the cost of
    a longer chunk, so the budget errs short. The whole ``max_tokens`` until a mixed step has
    been timed, and with ``target_s`` 0. The scheduler feeds it each step's time (`observe`)."""

    MIN_TIMED = 32
    """Steps with fewer prefill tokens (or fewer than ``floor``) say little about a chunk's
    cost: not observed."""
    ALPHA = 0.25
    """Weight of the newest observation."""

    def __init__(self, target_s: float, max_tokens: int, floor: int) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.floor = min(floor, max_tokens)
        self.min_timed = min(self.MIN_TIMED, self.floor)
        self.per_token_s: float | None = None

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        if self.target_s <= 0 or not decodes or prefill_tokens < self.min_timed or seconds <= 0:
            return
        per = seconds / (prefill_tokens + decodes)
        self.per_token_s = per if self.per_token_s is None \
            else self.per_token_s + self.ALPHA * (per - self.per_token_s)

    def tokens(self) -> int:
        """A mixed step's token budget (decode rows included), at least ``floor``."""
        if self.target_s <= 0 or self.per_token_s is None:
            return self.max_tokens
        return max(self.floor, min(self.max_tokens, int(self.target_s / self.per_token_s)))


class Scheduler:
    """Owns the waiting queue and the running batch; allocates KV blocks for each step."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_batch_tokens: int, mixed_batches: bool, key_extra: tuple[object, ...],
                 mixed_step_s: float = 0.0):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.mixed_batches = mixed_batches
        self.budget = MixedBudget(mixed_step_s, max_batch_tokens, floor=4 * block_size)
        self.key_extra = key_extra
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, new_tokens: int) -> int:
        total = -(-(seq.num_computed + new_tokens) // self.block_size)
        return max(0, total - len(seq.blocks))

    def _grow(self, seq: Sequence, new_tokens: int) -> bool:
        need = self._blocks_needed(seq, new_tokens)
        if need > self.allocator.num_free:
            return False
        seq.blocks.extend(self.allocator.allocate_many(need))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Release ``seq``'s KV and requeue it at the head of the waiting queue."""
        self.running.remove(seq)
        self.allocator.release_all(seq.blocks)
        seq.blocks, seq.keys, seq.num_computed = [], [], 0
        seq.phase = Phase.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.info("preempted %s (%s tokens) for lack of KV blocks", seq.request_id, seq.num_tokens)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        if self.mixed_batches:
            decodes = self._schedule_decodes(plan)
            limit = self.budget.tokens() if decodes else self.max_batch_tokens
            # many decodes still leave a chunk its floor: a prompt always advances
            self._schedule_prefills(plan, min(self.max_batch_tokens - decodes,
                                              max(limit - decodes, self.budget.floor)))
        else:
            self._schedule_prefills(plan, self.max_batch_tokens)
            if not plan.prefills:
                self._schedule_decodes(plan)
        return plan

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """The engine's time for ``plan``'s forward pass (a mixed step's sizes the next)."""
        self.budget.observe(sum(n for _, n in plan.prefills), len(plan.decodes), seconds)

    def _schedule_decodes(self, plan: StepPlan) -> int:
        for seq in list(self.running):
            if seq.phase != Phase.RUNNING or seq.is_prefilling:
                continue
            while not self._grow(seq, 1):
                victim = self.running[-1]
                plan.preempted.append(victim)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.phase == Phase.RUNNING:
                plan.decodes.append(seq)
        return len(plan.decodes)

    def _schedule_prefills(self, plan: StepPlan, budget: int) -> None:
        for seq in self.running:
            if budget <= 0:
                return
            if not seq.is_prefilling:
                continue
            n = min(seq.num_ready, budget, self._fit(seq))
            if n > 0 and self._grow(seq, n):
                plan.prefills.append((seq, n))
                budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            n = min(seq.num_ready, budget, self._fit(seq))
            if n <= 0 or not self._grow(seq, n):
                self.allocator.release_all(seq.blocks)
                seq.blocks, seq.keys, seq.num_computed, seq.num_cached_tokens = [], [], 0, 0
                break
            self.waiting.popleft()
            seq.phase = Phase.RUNNING
            self.running.append(seq)
            if self.mixed_batches and seq.num_pending == 1 and not seq.staged:
                # its KV is all there (imported, or a full prefix hit): one more decode row
                # instead of a 1-token prefill chunk, which would run the whole step op by op
                plan.decodes.append(seq)
                plan.joined.append(seq)
            else:
                plan.prefills.append((seq, n))
            budget -= n

    def _fit(self, seq: Sequence) -> int:
        """Most new tokens ``seq`` can take with the blocks it has plus the free ones."""
        capacity = (len(seq.blocks) + self.allocator.num_free) * self.block_size
        return capacity - seq.num_computed

    def _admit(self, seq: Sequence) -> bool:
        """Prefix-cache lookup for a new (or preempted) sequence; acquires the hit blocks."""
        if seq.num_computed or seq.blocks:
            return True  # KV already imported for it
        keys, hits = self._prefix_hits(seq.all_ids, seq.prefix_tokens)
        for b in hits:
            self.allocator.acquire(b)
        seq.blocks = hits
        seq.keys = keys[: len(hits)]
        seq.num_computed = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed
        return True

    def cached_tokens(self, ids: list[int], limit: int | None = None) -> int:
        """Prompt tokens of ``ids`` the prefix cache holds now (up to ``limit``), in whole
        blocks, as `_admit` would reuse them (nothing acquired)."""
        return len(self._prefix_hits(ids, limit)[1]) * self.block_size

    def _prefix_hits(self, ids: list[int], limit: int | None
                     ) -> tuple[list[BlockHash], list[int]]:
        """The chained keys of ``ids``' full blocks (all but the last token) and the cached
        blocks of its leading run, at most ``limit`` tokens of them (a pipeline stage: the
        group's common prefix; None: no limit); not acquired."""
        bs = self.block_size
        full = (len(ids) - 1) // bs
        if not (full and self.allocator.enable_prefix_cache) or limit == 0:
            return [], []
        keys = hash_blocks(ids[: full * bs], bs, self.key_extra)
        hits = self.allocator.match_prefix(keys, [ids[i * bs:(i + 1) * bs] for i in range(full)])
        return keys, hits if limit is None else hits[:limit // bs]

    def commit(self, plan: StepPlan) -> None:
        """After the forward pass: advance ``num_computed`` and publish newly full blocks."""
        for seq in plan.decodes:
            seq.num_computed += 1
            self.publish(seq)
        for seq, n in plan.prefills:
            seq.num_computed += n
            self.publish(seq)

    def publish(self, seq: Sequence) -> None:
        bs = self.block_size
        ids: list[int] | None = None
        while len(seq.keys) < seq.num_computed // bs:
            ids = ids if ids is not None else seq.all_ids
            i = len(seq.keys)
            tokens = ids[i * bs:(i + 1) * bs]
            key = hash_block(seq.keys[-1] if seq.keys else None, tokens, self.key_extra)
            self.allocator.register(seq.blocks[i], key, tokens)
            seq.keys.append(key)

    def detach(self, seq: Sequence) -> None:
        """Drop a finished sequence from the queues but keep its blocks allocated."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def free(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks."""
        self.detach(seq)
        self.allocator.release_all(seq.blocks)
        seq.blocks = []

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
