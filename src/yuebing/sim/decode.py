"""A simulated decode instance: continuous batching bounded by HBM.

Life cycle of a request here: its KV arrives (`DecodeInstance.enqueue`) and waits in FIFO
order until its whole footprint (prompt + first token + remaining output, reserved up front
so no running request is ever preempted) fits in the instance's KV capacity; it is then
admitted at the next iteration boundary, produces one token per iteration, and leaves after
its last token, freeing its KV. Each iteration takes ``cost.decode_step_time(batch, context)``
where ``context`` is the batch's total KV tokens.

For speed the instance keeps one list of iteration end times; a request remembers the index
of its first iteration, and its token times are a slice of that list (no per-token events or
per-token Python work), turned into TBT when it leaves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from yuebing.sim.hardware import CostModel
from yuebing.sim.loop import EventLoop, Priority
from yuebing.sim.metrics import RequestRecord


@dataclass(slots=True)
class DecodeJob:
    """A request on (or waiting for) a decode instance."""

    record: RequestRecord
    input_tokens: int
    output_tokens: int
    first_step: int = -1

    @property
    def kv_tokens(self) -> int:
        """KV reserved for the request: the prompt plus every output token."""
        return self.input_tokens + self.output_tokens


class DecodeInstance:
    """One decode node. Driven by the event loop; `enqueue` is called by the owning system
    when a request's KV is complete on this node; ``on_finish`` (optional) is called after a
    request's record is finalized."""

    def __init__(self, name: str, loop: EventLoop, cost: CostModel,
                 on_finish: Callable[[DecodeJob], None] | None = None) -> None:
        self.name = name
        self.loop = loop
        self.cost = cost
        self.capacity = cost.decode_kv_capacity_tokens
        self.on_finish = on_finish
        self.waiting: deque[DecodeJob] = deque()
        self.waiting_tokens = 0
        """Sum of the prompt lengths of the waiting jobs."""
        self.batch_size = 0
        self.context_tokens = 0
        self.kv_reserved = 0
        """KV tokens reserved by the running batch."""
        self.step_ends: list[float] = []
        self._finish_at: dict[int, list[DecodeJob]] = {}
        self._running = False

    def enqueue(self, job: DecodeJob) -> None:
        """The job's KV is here: wait for room, join the batch at the next iteration."""
        if job.output_tokens < 2:
            raise ValueError(f"{self.name}: request {job.record.index} has no token to decode "
                             "(output_tokens < 2); finish it at its first token instead")
        if job.kv_tokens > self.capacity:
            raise ValueError(f"{self.name}: request {job.record.index} needs {job.kv_tokens} KV "
                             f"tokens, more than the instance holds ({self.capacity})")
        self.waiting.append(job)
        self.waiting_tokens += job.input_tokens
        if not self._running:
            self._admit()
            self._start_step()

    def can_admit_now(self, job: DecodeJob) -> bool:
        """Would ``job`` join the batch at the next iteration (nobody waiting, KV fits)?"""
        return not self.waiting and self.kv_reserved + job.kv_tokens <= self.capacity

    @property
    def kv_used(self) -> int:
        """Reserved by the batch plus needed by the waiting jobs."""
        return self.kv_reserved + self.waiting_tokens + sum(j.output_tokens for j in self.waiting)

    def _admit(self) -> None:
        step = len(self.step_ends)
        waiting = self.waiting
        while waiting and self.kv_reserved + waiting[0].kv_tokens <= self.capacity:
            job = waiting.popleft()
            self.waiting_tokens -= job.input_tokens
            job.first_step = step
            job.record.decode_start_s = self.loop.now
            self.kv_reserved += job.kv_tokens
            self.batch_size += 1
            self.context_tokens += job.input_tokens + 1
            last = step + job.output_tokens - 2
            bucket = self._finish_at.get(last)
            if bucket is None:
                self._finish_at[last] = [job]
            else:
                bucket.append(job)

    def _start_step(self) -> None:
        if self.batch_size == 0:
            self._running = False
            return
        self._running = True
        dt = self.cost.decode_step_time(self.batch_size, self.context_tokens)
        self.loop.after(dt, Priority.COMPLETE, self._step_done)

    def _step_done(self) -> None:
        step = len(self.step_ends)
        ends = self.step_ends
        ends.append(self.loop.now)
        self.context_tokens += self.batch_size
        done = self._finish_at.pop(step, None)
        if done:
            for job in done:
                self.batch_size -= 1
                self.context_tokens -= job.input_tokens + job.output_tokens
                self.kv_reserved -= job.kv_tokens
                rec = job.record
                rec.finish_decode([rec.first_token_s, *ends[job.first_step:step + 1]])
                if self.on_finish is not None:
                    self.on_finish(job)
        if self.waiting:
            self._admit()
        self._start_step()
