"""Drives a bench: check the endpoint, send the requests on schedule, collect the results.

Life cycle (`run_bench`): every workload is built before this is called (bad traces and
options fail there); one aiohttp session is opened; `check_endpoint` resolves the model (an
unreachable endpoint or a model it lacks is an `InputError` before any load); then each
workload (one, or one per rate of a sweep, in order) runs to completion:

- open loop (`open_loop`): request i is sent at its ``send_s`` after the run's start,
  whatever is still in flight (arrivals as in the trace, or Poisson);
- closed loop (`closed_loop`, ``--concurrency N``): N workers each send the next request as
  soon as their previous one ends.

With ``stop_on_miss`` the workloads after the first whose attainment misses the target are
not run. ``on_done`` is called with each finished `RequestResult` (the CLI's progress bar).
Each run's results come back in request order with their `summarize` aggregates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from yuebing.bench.client import check_endpoint, open_session, send
from yuebing.bench.config import BenchConfig
from yuebing.bench.metrics import summarize
from yuebing.bench.result import RequestResult
from yuebing.bench.workload import BenchRequest

log = logging.getLogger(__name__)
OnDone = Callable[[RequestResult], None]


@dataclass(frozen=True)
class Run:
    """One workload's outcome."""

    label: str
    """How requests were sent: ``"2 req/s"``, ``"8 in flight"``, ``"trace timing ×4"``."""
    rate: float | None
    """Poisson rate of the run (None: trace timestamps or closed loop)."""
    results: tuple[RequestResult, ...]
    summary: dict[str, Any]
    interrupted: bool = False
    """Stopped by Ctrl-C: ``results`` holds only the requests answered before it."""


def run_label(cfg: BenchConfig, rate: float | None) -> str:
    """The label of a run at ``rate`` (None: the trace's timing or a closed loop)."""
    if rate is not None:
        return f"{rate:g} req/s"
    if cfg.concurrency:
        return f"{cfg.concurrency} in flight"
    return "trace timing" + (f" ×{cfg.speed:g}" if cfg.speed != 1.0 else "")


def _clock() -> Callable[[], float]:
    t0 = time.perf_counter()
    return lambda: time.perf_counter() - t0


async def open_loop(session: aiohttp.ClientSession, requests: Sequence[BenchRequest],
                    cfg: BenchConfig, model: str, done: list[RequestResult],
                    on_done: OnDone | None = None) -> None:
    """Send each request at its scheduled time; append each answer to ``done``. Cancelled
    (Ctrl-C), it cancels the requests in flight and returns once they are gone."""
    clock = _clock()

    async def one(req: BenchRequest) -> None:
        res = await send(session, req, cfg, model, clock)
        done.append(res)
        if on_done is not None:
            on_done(res)

    tasks = []
    try:
        for req in requests:
            delay = req.send_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def closed_loop(session: aiohttp.ClientSession, requests: Sequence[BenchRequest],
                      cfg: BenchConfig, model: str, done: list[RequestResult],
                      on_done: OnDone | None = None) -> None:
    """Keep ``cfg.concurrency`` requests in flight until all are answered (into ``done``)."""
    clock = _clock()
    pending = iter(requests)

    async def worker() -> None:
        for req in pending:  # one shared iterator: each request is taken once
            res = await send(session, req, cfg, model, clock)
            res.scheduled_s = res.start_s  # no schedule: sent when a worker is free
            done.append(res)
            if on_done is not None:
                on_done(res)

    await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, len(requests)))))


async def run_workloads(cfg: BenchConfig,
                        workloads: Sequence[tuple[float | None, Sequence[BenchRequest]]],
                        on_start: Callable[[float | None, int], None] | None = None,
                        on_done: OnDone | None = None) -> tuple[str, list[Run]]:
    """(model, one `Run` per workload); raises `InputError` before any load when the endpoint
    cannot be used. Cancelled mid-run (Ctrl-C under `run_bench`), it stops sending, drops the
    requests in flight and returns the runs so far, the last one marked ``interrupted``."""
    runs = []
    async with open_session(cfg) as session:
        model = await check_endpoint(session, cfg)
        for rate, requests in workloads:
            if on_start is not None:
                on_start(rate, len(requests))
            loop = closed_loop if cfg.concurrency else open_loop
            done: list[RequestResult] = []
            interrupted = False
            try:
                await loop(session, requests, cfg, model, done, on_done)
            except asyncio.CancelledError:
                interrupted = True
                log.warning("interrupted: %d of %d requests of this run answered",
                            len(done), len(requests))
            done.sort(key=lambda r: r.index)
            runs.append(Run(run_label(cfg, rate), rate, tuple(done), summarize(done, cfg),
                            interrupted))
            if interrupted or (cfg.stop_on_miss
                               and runs[-1].summary["attainment"] < cfg.target_attainment):
                break
    return model, runs


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to the hard one (each request in flight
    holds a socket; a client out of descriptors would show as connect errors). The limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
        return hard
    return soft


def run_bench(cfg: BenchConfig,
              workloads: Sequence[tuple[float | None, Sequence[BenchRequest]]],
              on_start: Callable[[float | None, int], None] | None = None,
              on_done: OnDone | None = None) -> tuple[str, list[Run]]:
    """`run_workloads` on a fresh event loop (the CLI's entry), with the open-files limit
    raised first."""
    limit = raise_open_files_limit()
    log.debug("open files limit %d", limit)
    return asyncio.run(run_workloads(cfg, workloads, on_start, on_done))
