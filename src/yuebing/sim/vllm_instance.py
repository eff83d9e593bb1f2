"""One simulated coupled vLLM-like instance (paper §5.1 baselines, vLLM v0 scheduling): prefill
and decode share the node's GPUs. Driven by `sim.vllm.VllmSystem`.

A request waits FIFO until its whole KV (prompt + output, reserved up front: no preemption)
fits in HBM; without chunked prefill a prefill-only step stalls the running decodes, with it
every step is mixed under a token budget. With prefix caching the longest cached run of its
leading blocks is reused (an HBM LRU). As in `sim.decode`, a request's token times are a slice
of the instance's iteration end times; `CoupledInstance` details each stage.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from yuebing.sim.loop import EventLoop, Priority
from yuebing.sim.metrics import RequestRecord
from yuebing.sim.vllm_cost import CoupledCost
from yuebing.sim.workload import SimRequest


@dataclass(slots=True)
class CoupledJob:
    """A request on a coupled instance."""

    request: SimRequest
    record: RequestRecord
    hit: int = 0
    """Prompt tokens reused from the prefix cache."""
    done: int = 0
    """Prompt tokens computed so far (chunked prefill)."""
    first_step: int = -1

    @property
    def kv_tokens(self) -> int:
        return self.request.input_tokens + self.request.output_tokens


def _share_gpu_time(seconds: float, chunks: list[tuple[CoupledJob, int]]) -> None:
    """Add a step's prefill seconds to its requests' ``prefill_gpu_s`` in proportion to the
    prompt tokens each computed in it."""
    total = sum(n for _, n in chunks)
    for job, n in chunks:
        job.record.prefill_gpu_s += seconds * n / total if total else seconds / len(chunks)


class CoupledInstance:
    """One node running a vLLM-like engine. Driven by the event loop; `submit` is called by
    the owning system (`yuebing.sim.vllm.VllmSystem`) when a request is dispatched here.

    1. `submit`: the request waits FIFO until its KV footprint fits in HBM next to the running
       batch and the batch has fewer than ``max_num_seqs`` sequences.
    2. Without chunked prefill, prefill has priority: whenever the head of the queue can be
       admitted, the next iteration is a prefill-only step over as many waiting requests as fit in
       ``max_num_batched_tokens`` — the running decodes stall for the whole step. With chunked
       prefill every iteration is mixed: one token per running request, then prompt chunks (partly
       prefilled requests first) until the budget is spent. A request's ``prefill_gpu_s`` is its
       share (by prompt tokens) of the steps' prefill compute.
    3. The step of its last prompt token emits its first token; then one token per decode-carrying
       iteration until its last, which frees its KV. Prefix-cache blocks are cached when its
       prefill ends; blocks of running requests are conservatively counted twice."""

    def __init__(self, name: str, loop: EventLoop, cost: CoupledCost, capacity_tokens: int,
                 block_tokens: int, prefix_caching: bool, chunked: bool,
                 max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.name, self.loop, self.cost = name, loop, cost
        self.capacity = capacity_tokens
        self.block_tokens = block_tokens
        self.prefix_caching, self.chunked = prefix_caching, chunked
        self.budget, self.max_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[CoupledJob] = deque()
        self.prefilling: deque[CoupledJob] = deque()
        self.outstanding_tokens = 0
        """Prompt tokens dispatched here and not yet computed (routing load)."""
        self.running = 0
        self.context_tokens = 0
        self.kv_reserved = 0
        self.token_ends: list[float] = []
        self._finish_at: dict[int, list[CoupledJob]] = {}
        self._busy = False
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_evictions = 0

    # -- entry --------------------------------------------------------------------------------
    def submit(self, job: CoupledJob) -> None:
        """Queue a request (its footprint must fit in this instance's HBM)."""
        if job.kv_tokens > self.capacity:
            raise ValueError(f"{self.name}: request {job.record.index} needs {job.kv_tokens} KV "
                             f"tokens, more than the instance holds ({self.capacity})")
        self.waiting.append(job)
        self.outstanding_tokens += job.request.input_tokens
        if not self._busy:
            self._next_step()

    # -- scheduling -----------------------------------------------------------------------------
    def _admissible(self) -> bool:
        if not self.waiting:
            return False
        in_flight = self.running + len(self.prefilling)
        return (in_flight < self.max_seqs
                and self.kv_reserved + self.waiting[0].kv_tokens <= self.capacity)

    def _admit(self) -> CoupledJob:
        job = self.waiting.popleft()
        self.kv_reserved += job.kv_tokens
        req = job.request
        job.record.prefill_id = job.record.decode_id = self.name
        job.record.prefill_start_s = self.loop.now
        if self.prefix_caching:
            job.hit = self._lookup(req.block_keys, req.input_tokens)
            job.record.hit_tokens = job.hit
            self.outstanding_tokens -= job.hit
            self._fit_cache()
        job.done = job.hit
        return job

    def _next_step(self) -> None:
        if self.chunked:
            self._mixed_step()
        elif self._admissible():
            self._prefill_step()
        elif self.running:
            self.loop.after(self.cost.decode_step(self.running, self.context_tokens),
                            Priority.COMPLETE, self._decode_done)
            self._busy = True
        else:
            self._busy = False

    def _prefill_step(self) -> None:
        batch: list[CoupledJob] = []
        tokens = 0
        while self._admissible():
            head = self.waiting[0]
            if batch and tokens + head.request.input_tokens > self.budget:
                break
            job = self._admit()
            tokens += job.request.input_tokens - job.hit
            batch.append(job)
        parts = [(j.request.input_tokens - j.hit, j.hit) for j in batch]
        self._busy = True
        duration = self.cost.prefill_step(parts)
        _share_gpu_time(duration, [(j, n) for j, (n, _) in zip(batch, parts, strict=True)])
        self.loop.after(duration, Priority.COMPLETE, self._prefill_done, batch)

    def _prefill_done(self, batch: list[CoupledJob]) -> None:
        for job in batch:
            self._prompt_finished(job)
        self._next_step()

    def _mixed_step(self) -> None:
        decodes = self.running
        budget = self.budget - decodes
        parts: list[tuple[int, int]] = []
        chunks: list[tuple[CoupledJob, int]] = []
        for job in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, job.request.input_tokens - job.done)
            parts.append((n, job.done))
            chunks.append((job, n))
            budget -= n
        while budget > 0 and self._admissible():
            job = self._admit()
            self.prefilling.append(job)
            n = min(budget, job.request.input_tokens - job.done)
            parts.append((n, job.done))
            chunks.append((job, n))
            budget -= n
        if not decodes and not chunks:
            self._busy = False
            return
        self._busy = True
        if chunks:
            _share_gpu_time(self.cost.prefill_step(parts), chunks)
        self.loop.after(self.cost.mixed_step(parts, decodes, self.context_tokens),
                        Priority.COMPLETE, self._mixed_done, decodes > 0, chunks)

    def _mixed_done(self, had_decodes: bool, chunks: list[tuple[CoupledJob, int]]) -> None:
        if had_decodes:
            self._decode_tokens()
        for job, n in chunks:
            job.done += n
            self.outstanding_tokens -= n
            if job.done >= job.request.input_tokens:
                self.prefilling.remove(job)
                self._prompt_finished(job, chunked=True)
        self._next_step()

    # -- token bookkeeping ----------------------------------------------------------------------
    def _prompt_finished(self, job: CoupledJob, chunked: bool = False) -> None:
        req, rec, now = job.request, job.record, self.loop.now
        if not chunked:
            self.outstanding_tokens -= req.input_tokens - job.hit
        rec.first_token_s = rec.kv_ready_s = rec.decode_start_s = now
        if self.prefix_caching:
            self._insert(req.block_keys)
        if req.output_tokens < 2:
            self.kv_reserved -= job.kv_tokens
            rec.finish_decode([now])
            return
        job.first_step = len(self.token_ends)
        self.running += 1
        self.context_tokens += req.input_tokens + 1
        last = job.first_step + req.output_tokens - 2
        bucket = self._finish_at.get(last)
        if bucket is None:
            self._finish_at[last] = [job]
        else:
            bucket.append(job)

    def _decode_done(self) -> None:
        self._decode_tokens()
        self._next_step()

    def _decode_tokens(self) -> None:
        step = len(self.token_ends)
        ends = self.token_ends
        ends.append(self.loop.now)
        self.context_tokens += self.running
        done = self._finish_at.pop(step, None)
        if not done:
            return
        for job in done:
            req = job.request
            self.running -= 1
            self.context_tokens -= req.input_tokens + req.output_tokens
            self.kv_reserved -= job.kv_tokens
            job.record.finish_decode([job.record.first_token_s, *ends[job.first_step:step + 1]])
        if self.prefix_caching:
            self._fit_cache()

    # -- prefix cache ---------------------------------------------------------------------------
    def _lookup(self, keys: tuple[int, ...], input_tokens: int) -> int:
        cache = self.cache
        m = 0
        for key in keys:
            if key not in cache:
                break
            m += 1
        for key in reversed(keys[:m]):
            cache.move_to_end(key)
        return min(m * self.block_tokens, input_tokens - 1)

    def _insert(self, keys: tuple[int, ...]) -> None:
        cache = self.cache
        for key in reversed(keys):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
        self._fit_cache()

    def _fit_cache(self) -> None:
        limit = max(0, (self.capacity - self.kv_reserved) // self.block_tokens)
        cache = self.cache
        while len(cache) > limit:
            cache.popitem(last=False)
            self.cache_evictions += 1
