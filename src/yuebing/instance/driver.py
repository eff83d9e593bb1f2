"""`EngineDriver`: the one thread that owns an `LLMEngine`, created by `Instance` for every role.

The engine is single-threaded, so every call into it is a closure queued with `call` / `run`
and run by the driver thread between two steps; the control loop never blocks on a step. The
thread runs queued calls, then one `engine.step()` if there is work, handing the outputs to
``on_outputs`` (driver thread), and sleeps when there is neither. Each step's time is recorded
(`StepStats`, for load reports); ``--step-trace-dir`` appends one JSON line per step; with a
`CoreLedger` (``--lend-cores``) a step also runs on the host's idle cores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import torch

from yuebing.engine.engine import LLMEngine
from yuebing.engine.sequence import RequestOutput
from yuebing.instance.cores import CoreLedger

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.005
"""How long the driver sleeps when requests wait but no step could be planned."""


@dataclass
class StepStats:
    """Exponentially averaged step costs, read by load reports (any thread; plain floats)."""

    decode_step_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    steps: int = 0
    last_step_end: float = 0.0
    last_step_s: float = 0.0
    alpha: float = 0.2
    busy_s: float = 0.0
    """Seconds of steps so far."""
    thread_s: float = 0.0
    """Thread-seconds of steps so far (each step's seconds times its threads)."""

    def record(self, seconds: float, prefill_tokens: int, decodes: int,
               threads: int = 0) -> None:
        self.steps += 1
        self.busy_s += seconds
        self.thread_s += seconds * threads
        self.last_step_end = time.time()
        self.last_step_s = seconds
        if prefill_tokens == 0 and decodes:
            self.decode_step_s = _ewma(self.decode_step_s, seconds, self.alpha)
        elif prefill_tokens and seconds > 0:
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s,
                                              prefill_tokens / seconds, self.alpha)


def _ewma(old: float, new: float, alpha: float) -> float:
    return new if old == 0 else (1 - alpha) * old + alpha * new


class DriverStopped(RuntimeError):
    """A call queued to a stopped driver (or still queued when it stopped): it never ran."""


class EngineDriver:
    """Runs ``engine`` in a dedicated thread; see the module docstring.

    ``step_trace``: a file to append one JSON line per step to — ``{"t": wall-clock start,
    "step_s": engine.step() seconds, "out_s": seconds until the outputs were handed on,
    "decodes", "prefill_tokens", "prefill_cached_tokens", "joined", "joined_context", "threads",
    "context_tokens"}`` — which tells a live run's token interval from the engine's step time
    (benchmarks/sim_vs_live.py reads it); written line by line (a running or killed instance's
    steps are all there), closed with the driver. ``ledger``: each step runs with this
    instance's threads plus the host's unclaimed cores, never more threads than the host has."""

    def __init__(self, engine: LLMEngine,
                 on_outputs: Callable[[list[RequestOutput]], None],
                 threads: int = 1, name: str = "engine",
                 step_trace: Path | None = None, ledger: CoreLedger | None = None) -> None:
        self.engine = engine
        self.ledger = ledger
        """The host's core ledger: steps borrow idle instances' threads (None: never)."""
        self._threads_now = 0
        self._trace: IO[str] | None = None
        if step_trace is not None:
            step_trace.parent.mkdir(parents=True, exist_ok=True)
            self._trace = step_trace.open("a", buffering=1)  # a line per step: one write
        self.on_outputs = on_outputs
        self.threads = threads
        self.stats = StepStats()
        self._calls: deque[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]]] = \
            deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn(engine)`` for the driver thread; its result or exception in the future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cv:
            if self._stop:
                fut.set_exception(DriverStopped("the engine driver is stopped"))
                return fut
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """`call` awaited from asyncio."""
        return await asyncio.wrap_future(self.call(fn))

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def marks(self) -> tuple[float, float]:
        """(thread-seconds, seconds) of steps so far, for `mean_threads` (driver thread)."""
        return self.stats.thread_s, self.stats.busy_s

    def mean_threads(self, since: tuple[float, float]) -> float:
        """The time-weighted mean threads of the steps since the `marks` ``since`` (driver
        thread; 0 if none ran)."""
        thread_s, busy_s = self.marks()
        dt = busy_s - since[1]
        return (thread_s - since[0]) / dt if dt > 0 else 0.0

    def step_threads(self) -> int:
        """The threads a step begun now would run with (0: no ledger, it never borrows)."""
        return self.ledger.threads_now() if self.ledger is not None else 0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ driver thread

    def _loop(self) -> None:
        self._use_threads(max(1, self.threads))
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stop and not self._calls and \
                            not self.engine.has_unfinished():
                        if self.ledger is not None:  # idle: lend our cores
                            self.ledger.release(idle=True)
                        self._cv.wait()
                    if self._stop:
                        break
                    calls = list(self._calls)
                    self._calls.clear()
                for fn, fut in calls:
                    self._run_call(fn, fut)
                if self.engine.has_unfinished():
                    if self.ledger is not None:
                        self._use_threads(self.ledger.acquire())
                    try:
                        self._step()
                    finally:
                        if self.ledger is not None:
                            self.ledger.release(idle=False)
        if self.ledger is not None:
            self.ledger.close()
        with self._cv:
            pending = list(self._calls)
            self._calls.clear()
        for _, fut in pending:
            if fut.set_running_or_notify_cancel():  # a caller may have cancelled it
                fut.set_exception(DriverStopped("the engine driver stopped"))
        if self._trace is not None:
            self._trace.close()

    def _use_threads(self, n: int) -> None:
        if n != self._threads_now:
            torch.set_num_threads(n)
            self._threads_now = n

    def _run_call(self, fn: Callable[[LLMEngine], Any],
                  fut: concurrent.futures.Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self.engine))
        except BaseException as e:
            fut.set_exception(e)

    def _step(self) -> None:
        wall = time.time()
        t0 = time.perf_counter()
        before = self.engine.num_steps
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; aborting every running request")
            outputs = self._abort_all("engine step failed")
        dt = time.perf_counter() - t0
        plan = self.engine.last_plan
        if self.engine.num_steps != before and plan is not None:
            self.stats.record(dt, sum(n for _, n in plan.prefills), len(plan.decodes),
                              self._threads_now)
        elif not outputs:
            # nothing could be scheduled (KV held by reservations or finished requests): wait
            # for a call (release, abort, import) instead of spinning on empty plans
            with self._cv:
                if not self._calls and not self._stop:
                    self._cv.wait(IDLE_WAIT_S)
        if outputs:
            try:
                self.on_outputs(outputs)
            except Exception:
                log.exception("output handler failed")
        if self._trace is not None and plan is not None and self.engine.num_steps != before:
            self._trace.write(json.dumps({
                "t": round(wall, 6), "step_s": round(dt, 6),
                "out_s": round(time.perf_counter() - t0, 6), "decodes": len(plan.decodes),
                "prefill_tokens": sum(n for _, n in plan.prefills),
                # what the chunks attended over before them (a prompt's prefix, earlier chunks)
                "prefill_cached_tokens": sum(seq.num_computed - n for seq, n in plan.prefills),
                # decodes that joined this step (a new request's first step here) and the
                # context they attended over (its prompt, on a decode instance)
                "joined": len(plan.joined),
                "joined_context": sum(seq.num_computed - 1 for seq in plan.joined),
                "threads": self._threads_now,
                # each decode has its new token by now: the step attended over one fewer
                "context_tokens": sum(seq.num_tokens - 1 for seq in plan.decodes)}) + "\n")

    def _abort_all(self, reason: str) -> list[RequestOutput]:
        outs = []
        for seq in list(self.engine._seqs.values()):
            if self.engine.abort(seq.group):  # every choice of the request at once
                outs.append(RequestOutput(seq.group, [], "", list(seq.output_ids), seq.text,
                                          True, "error", len(seq.prompt_ids),
                                          seq.num_cached_tokens))
        log.error("aborted %d requests: %s", len(outs), reason)
        return outs
