"""A simulated decode instance (`DecodeInstance`): continuous batching bounded by HBM, used by
`sim.mooncake`.

A request's KV arrives (`enqueue`) and waits FIFO until its whole footprint (prompt + every
output token, reserved up front: no preemption) fits; it joins at the next iteration boundary,
makes one token per iteration and leaves after its last, freeing its KV. An iteration takes
``cost.decode_step_time(batch, context)`` (longer beside a prefilling host-mate: ``stretch``;
``tail`` times that on the steps `SlowSteps` draws slow). Between two batch changes the
iterations are planned at once, one event per change.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from yuebing.sim.hardware import CostModel
from yuebing.sim.loop import EventLoop, Priority
from yuebing.sim.metrics import RequestRecord

MAX_PLAN_STEPS = 32
"""Longest run of iterations planned in one event (bounds the work thrown away when an
arrival truncates a plan)."""
SLOW_SHARE = 0.1
"""The share of slow steps (`SlowSteps`): the paper TBT's longest tenth of intervals."""


class SlowSteps:
    """Which steps of one decode node are slow (`SimConfig.decode_tail`): each independently
    with probability `SLOW_SHARE`, drawn in step order from ``rng`` (one stream per node), so
    step k is slow or not whatever plans and re-plans came before it. A slow step takes
    ``tail`` times its cost-model time; the others take that time. Then a request with a tenth
    of its steps slow has a paper TBT of ``tail`` times its step, about half of the long ones
    do, and the 0.9 quantile of paper TBT per step over requests, what the live Conductor
    learns as its TBT tail, is ``tail``: the jitter of live steps (the OS, the Conductor and
    the load generator on the same cores, caches) that the profile's mean step leaves out."""

    def __init__(self, tail: float, rng: random.Random) -> None:
        if not (math.isfinite(tail) and tail >= 1.0):
            raise ValueError(f"the decode tail must be a finite number >= 1, got {tail}")
        self.tail = tail
        self._rng = rng
        self._slow = bytearray()
        """Per step index, whether it is slow (drawn up to the latest step asked for)."""

    def factor(self, step: int) -> float:
        """The slowdown of the node's step number ``step`` (0-based): ``tail`` or 1."""
        slow = self._slow
        while len(slow) <= step:
            slow.append(self._rng.random() < SLOW_SHARE)
        return self.tail if slow[step] else 1.0


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
    request's record is finalized.

    The plan appends the iterations' end times to ``step_ends`` and schedules one event where the
    next request finishes; a request arriving mid-plan truncates it after the iteration in
    progress, so it joins at the very next boundary, exactly as with one event per iteration. A
    request's token times are a slice of ``step_ends``: no per-token events."""

    def __init__(self, name: str, loop: EventLoop, cost: CostModel,
                 on_finish: Callable[[DecodeJob], None] | None = None,
                 stretch: Callable[[float, float], float] | None = None,
                 slow: SlowSteps | None = None) -> None:
        self.name = name
        self.stretch = stretch
        """Colocated nodes only (`yuebing.sim.colocation.HostMate.decode_step`): ``(start,
        step time) -> duration`` of a step while the host-mate may be busy."""
        self.slow = slow
        """The node's slow steps (`SimConfig.decode_tail`), else None: even steps."""
        self.loop = loop
        self.cost = cost
        self.capacity = cost.decode_kv_capacity_tokens
        self.on_finish = on_finish
        self.waiting: deque[DecodeJob] = deque()
        self.waiting_tokens = 0
        """Sum of the prompt lengths of the waiting jobs."""
        self.waiting_output = 0
        self.batch_size = 0
        self._ctx0 = 0
        """Batch context at the start of the current plan."""
        self._plan_start = 0
        """Index in ``step_ends`` of the plan's first iteration."""
        self.kv_reserved = 0
        """KV tokens reserved by the running batch."""
        self.step_ends: list[float] = []
        self._areas: list[float] = []
        """Per step, ∫ cost-model step dt up to its end (the steps as predicted, without slow
        steps or ``stretch``): a request's `RequestRecord.step_mean_s`."""
        self._finish_at: dict[int, list[DecodeJob]] = {}
        self._finish_steps: list[int] = []
        self._gen = 0
        self._running = False

    # -- observation ---------------------------------------------------------------------------
    @property
    def context_tokens(self) -> int:
        """KV tokens of the running batch now (prompts + tokens generated so far)."""
        done = bisect_right(self.step_ends, self.loop.now, lo=self._plan_start) - self._plan_start
        return self._ctx0 + self.batch_size * max(0, done)

    @property
    def kv_used(self) -> int:
        """Reserved by the batch plus needed by the waiting jobs."""
        return self.kv_reserved + self.waiting_tokens + self.waiting_output

    def busy_until(self) -> float:
        """Estimated end of the running batch: the plan's end plus the last finishing job's
        remaining steps at the current step time (no later arrivals; now when idle)."""
        if not self._running:
            return self.loop.now
        ends = self.step_ends
        remaining = max(0, max(self._finish_steps) - (len(ends) - 1))
        return ends[-1] + remaining * self.cost.decode_step_time(self.batch_size,
                                                                  self.context_tokens)

    def replan(self) -> None:
        """Re-plan from the next step boundary (called when the host-mate's schedule changes,
        which changes the planned steps' durations)."""
        if self._running:
            self._truncate()

    def can_admit_now(self, job: DecodeJob) -> bool:
        """Would ``job`` join the batch at the next iteration (it and every job already
        waiting fit in the KV capacity)?"""
        return self.kv_used + job.kv_tokens <= self.capacity

    # -- input -----------------------------------------------------------------------------------
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
        self.waiting_output += job.output_tokens
        if not self._running:
            self._admit()
            self._plan()
        elif self.kv_reserved + job.kv_tokens <= self.capacity and len(self.waiting) == 1:
            self._truncate()

    # -- internals -------------------------------------------------------------------------------
    def _truncate(self) -> None:
        """End the plan at the first boundary at or after now (the iteration in progress)."""
        ends = self.step_ends
        m = bisect_left(ends, self.loop.now, lo=self._plan_start)
        if m >= len(ends) - 1:
            return  # the next boundary is already the plan's end
        del ends[m + 1:]
        del self._areas[m + 1:]
        self._gen += 1
        self.loop.at(ends[m], Priority.COMPLETE, self._boundary, self._gen)

    def _admit(self) -> None:
        step = len(self.step_ends)
        waiting = self.waiting
        while waiting and self.kv_reserved + waiting[0].kv_tokens <= self.capacity:
            job = waiting.popleft()
            self.waiting_tokens -= job.input_tokens
            self.waiting_output -= job.output_tokens
            job.first_step = step
            job.record.decode_start_s = self.loop.now
            self.kv_reserved += job.kv_tokens
            self.batch_size += 1
            self._ctx0 += job.input_tokens + 1
            last = step + job.output_tokens - 2
            bucket = self._finish_at.get(last)
            if bucket is None:
                self._finish_at[last] = [job]
                heapq.heappush(self._finish_steps, last)
            else:
                bucket.append(job)

    def _plan(self) -> None:
        """Plan iterations up to the next finishing one; schedule its boundary."""
        if self.batch_size == 0:
            self._running = False
            return
        self._running = True
        ends = self.step_ends
        start = len(ends)
        self._plan_start = start
        steps = min(self._finish_steps[0] - start + 1, MAX_PLAN_STEPS)
        b, ctx, t = self.batch_size, self._ctx0, self.loop.now
        step_time, stretch, slow = self.cost.decode_step_time, self.stretch, self.slow
        areas = self._areas
        area = areas[-1] if areas else 0.0
        for k in range(start, start + steps):
            step = step_time(b, ctx)
            work = step if slow is None else step * slow.factor(k)
            end = t + (work if stretch is None else stretch(t, work))
            area += step * (end - t)
            t = end
            ctx += b
            ends.append(t)
            areas.append(area)
        self._gen += 1
        self.loop.at(t, Priority.COMPLETE, self._boundary, self._gen)

    def _boundary(self, gen: int) -> None:
        if gen != self._gen:
            return  # superseded by a truncated plan
        ends = self.step_ends
        step = len(ends) - 1
        self._ctx0 += self.batch_size * (step - self._plan_start + 1)
        self._plan_start = step + 1
        if self._finish_steps and self._finish_steps[0] == step:
            heapq.heappop(self._finish_steps)
            for job in self._finish_at.pop(step):
                self.batch_size -= 1
                self._ctx0 -= job.input_tokens + job.output_tokens
                self.kv_reserved -= job.kv_tokens
                rec = job.record
                rec.finish_decode([rec.first_token_s, *ends[job.first_step:step + 1]])
                if step > job.first_step:  # from its second token, as the Conductor's ledger
                    rec.step_mean_s = ((self._areas[step] - self._areas[job.first_step])
                                       / (ends[step] - ends[job.first_step]))
                if self.on_finish is not None:
                    self.on_finish(job)
        if self.waiting:
            self._admit()
        self._plan()
