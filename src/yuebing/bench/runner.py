"""Drives a bench (`yuebing bench serve`): check the endpoint, send the requests on schedule,
collect the results.

`run_bench` opens one aiohttp session, resolves the model (`check_endpoint`: an unreachable
endpoint or a missing model fails before any load), then runs each workload (one, or one per
rate of a sweep) open loop (each request at its ``send_s``) or closed loop (``--concurrency N``
workers). ``stop_on_miss``, ``sweep_down`` and ``stop_when_decided`` (`Decider`,
`bound_summary`) end a sweep or a run early; results come back in request order with their
`summarize` aggregates.
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
    cut_short: bool = False
    """Ended once it could no longer reach the target (``stop_when_decided``)."""


class Decider:
    """Counts a run's misses as answers arrive; `missed_for_certain` turns true once the run
    cannot reach ``cfg.target_attainment`` whatever its unanswered requests do.

    With ``stop_when_decided`` an open-loop run ends as soon as more of its requests missed the
    first SLOs than the target allows: it stops sending, drops the requests in flight, and its
    summary's ``attainment`` is the bound ``(sent − missed) / sent`` that the rest could not have
    lifted to the target (``"cut_short"`` says how far it got; `bound_summary`)."""

    def __init__(self, cfg: BenchConfig, total: int) -> None:
        self.ttft_s, self.tbt_s = cfg.slo_ttft[0], cfg.slo_tbt[0]
        self.total = total
        """Requests of the whole run (sent or not)."""
        self.target = cfg.target_attainment
        self.misses = 0

    def add(self, res: RequestResult) -> None:
        if not res.meets(self.ttft_s, self.tbt_s):
            self.misses += 1

    @property
    def bound(self) -> float:
        """The best attainment the run can still end with."""
        return (self.total - self.misses) / self.total if self.total else 0.0

    @property
    def missed_for_certain(self) -> bool:
        return self.bound < self.target


def bound_summary(summary: dict[str, Any], results: Sequence[RequestResult], total: int,
                  misses: int) -> dict[str, Any]:
    """A cut-short run's summary made consistent: every attainment (the first SLOs', each cell
    of the SLO grid, ``capacity``) becomes the bound ``(total − missed there) / total`` over
    all ``total`` requests of the run, as if every unanswered one had met it; latencies,
    counts and goodput stay those of the ``results`` answered. ``cut_short`` says so."""
    def bound(ttft_s: float, tbt_s: float) -> float:
        missed = sum(1 for r in results if not r.meets(ttft_s, tbt_s))
        return (total - missed) / total if total else 0.0

    out = dict(summary)
    out["slo"] = [{**row, "attainment": bound(row["ttft_s"], row["tbt_s"])}
                  for row in summary["slo"]]
    out["attainment"] = out["slo"][0]["attainment"]
    first_ttft = summary["slo"][0]["ttft_s"]
    out["capacity"] = {str(round(row["tbt_s"] * 1000)): row["attainment"]
                       for row in out["slo"] if row["ttft_s"] == first_ttft}
    out["cut_short"] = {"answered": len(results), "of": total, "missed": misses,
                        "attainment_at_most": out["attainment"]}
    return out


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
                    on_done: OnDone | None = None, decider: Decider | None = None) -> bool:
    """Send each request at its scheduled time; append each answer to ``done``. With a
    ``decider`` it stops as soon as the run misses for certain and returns True (cut short).
    Cancelled (Ctrl-C), it cancels the requests in flight and returns once they are gone."""
    clock = _clock()
    decided = asyncio.Event()

    async def one(req: BenchRequest) -> None:
        res = await send(session, req, cfg, model, clock)
        done.append(res)
        if on_done is not None:
            on_done(res)
        if decider is not None:
            decider.add(res)
            if decider.missed_for_certain:
                decided.set()

    async def send_all() -> None:
        for req in requests:
            delay = req.send_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        await asyncio.gather(*tasks)

    tasks: list[asyncio.Task[None]] = []
    sender = asyncio.create_task(send_all())
    watcher = asyncio.create_task(decided.wait())
    try:
        await asyncio.wait((sender, watcher), return_when=asyncio.FIRST_COMPLETED)
        if sender.done():
            sender.result()  # a failure of the sending loop itself is raised here
        return not sender.done()
    finally:  # cancel everything before the first await: a Ctrl-C there leaves nothing running
        for t in (sender, watcher, *tasks):
            t.cancel()
        await asyncio.gather(sender, watcher, *tasks, return_exceptions=True)


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
    if cfg.sweep_down:  # highest rate first; each workload keeps its own prompts
        workloads = sorted(workloads, key=lambda w: -(w[0] or 0.0))
    async with open_session(cfg) as session:
        model = await check_endpoint(session, cfg)
        for rate, requests in workloads:
            if on_start is not None:
                on_start(rate, len(requests))
            done: list[RequestResult] = []
            interrupted = cut = False
            decider = (Decider(cfg, len(requests))
                       if cfg.stop_when_decided and not cfg.concurrency else None)
            try:
                if cfg.concurrency:
                    await closed_loop(session, requests, cfg, model, done, on_done)
                else:
                    cut = await open_loop(session, requests, cfg, model, done, on_done, decider)
            except asyncio.CancelledError:
                interrupted = True
                log.warning("interrupted: %d of %d requests of this run answered",
                            len(done), len(requests))
            done.sort(key=lambda r: r.index)
            summary = summarize(done, cfg)
            if cut and decider is not None:
                log.info("%s: misses the target for certain after %d answers (%d missed of %d)",
                         run_label(cfg, rate), len(done), decider.misses, len(requests))
                summary = bound_summary(summary, done, len(requests), decider.misses)
            runs.append(Run(run_label(cfg, rate), rate, tuple(done), summary, interrupted, cut))
            met = runs[-1].summary["attainment"] >= cfg.target_attainment
            if interrupted or (cfg.stop_on_miss and not met) or (cfg.sweep_down and met):
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
