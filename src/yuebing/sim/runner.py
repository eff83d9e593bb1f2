"""Run one simulation: trace requests through one system on one event loop.

Life cycle: `simulate` builds the event loop (seeded), the cost model and the system named in
the config, chains one arrival event per request (each arrival schedules the next, so the heap
stays small), samples the system's load every ``sample_interval_s`` while requests remain,
runs the loop to completion and returns a `SimResult` with every `RequestRecord`, the
aggregates (`yuebing.sim.metrics.summarize`), the load time series and the event count.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from yuebing.core.errors import InputError
from yuebing.sim.hardware import COST_MODELS, CostModel, FittedCostModel
from yuebing.sim.loop import EventLoop, Priority
from yuebing.sim.metrics import RequestRecord, summarize
from yuebing.sim.system import SYSTEMS, SimConfig, SimSystem, SystemContext
from yuebing.sim.workload import SimRequest

log = logging.getLogger(__name__)

_SYSTEM_MODULES = ("yuebing.sim.mooncake", "yuebing.sim.vllm")
MAX_SAMPLES = 1_000_000
"""Most load samples one run may take over its arrivals (a guard against a runaway interval)."""


def load_systems() -> None:
    """Import the modules that register systems (a missing optional one is skipped)."""
    for name in _SYSTEM_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            log.debug("system module %s not available", name)


def build_cost_model(config: SimConfig) -> CostModel:
    """The cost model named by ``config.cost_model`` (``fitted`` loads ``config.profile``)."""
    cls = COST_MODELS.get(config.cost_model)
    if cls is FittedCostModel:
        return FittedCostModel.from_file(config.profile)
    return cls()


@dataclass
class SimResult:
    """Everything one run produced."""

    config: SimConfig
    records: list[RequestRecord]
    summary: dict[str, object]
    timeseries: dict[str, list[float]]
    """``t_s`` plus one list per key of `SimSystem.load`, sampled every interval."""
    extra: dict[str, object]
    events: int
    wall_s: float
    sim_end_s: float = 0.0


class _Driver:
    """Feeds arrivals and samples into the loop (one instance per run)."""

    def __init__(self, loop: EventLoop, system: SimSystem, requests: Sequence[SimRequest],
                 records: list[RequestRecord], interval: float,
                 progress: Callable[[int], None] | None) -> None:
        self.loop, self.system, self.requests, self.records = loop, system, requests, records
        self.interval = interval
        self.progress = progress
        self.next = 0
        self.series: dict[str, list[float]] = {"t_s": []}

    def arrive(self) -> None:
        i = self.next
        self.next += 1
        req = self.requests[i]
        self.system.on_arrival(req, self.records[i])
        if self.next < len(self.requests):
            self.loop.at(self.requests[self.next].arrival_s, Priority.ARRIVAL, self.arrive)
        if self.progress is not None and (self.next % 256 == 0 or self.next == len(self.requests)):
            self.progress(self.next)

    def sample(self) -> None:
        self.series["t_s"].append(self.loop.now)
        for key, value in self.system.load().items():
            self.series.setdefault(key, []).append(value)
        if self.next < len(self.requests):
            self.loop.after(self.interval, Priority.SAMPLE, self.sample)


def simulate(requests: Sequence[SimRequest], config: SimConfig, cost: CostModel | None = None,
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Replay ``requests`` (sorted by arrival) through ``config.system``; see module docstring.
    With ``config.output_tokens`` every request gets that many output tokens.

    ``progress`` is called with the number of requests that arrived so far.
    """
    if not requests:
        raise InputError("simulate needs at least one request")
    if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:], strict=False)):
        raise InputError("requests must be sorted by arrival time")
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    if not span_s / config.sample_interval_s <= MAX_SAMPLES:
        raise InputError(
            f"sampling every {config.sample_interval_s:g} s over {span_s:g} s of arrivals would "
            f"take more than {MAX_SAMPLES:,} samples; raise sample_interval_s or the replay speed")
    if config.output_tokens:
        requests = [replace(r, output_tokens=config.output_tokens) for r in requests]
    load_systems()
    factory = SYSTEMS.get(config.system)
    cost = cost or build_cost_model(config)
    loop = EventLoop(seed=config.policy.seed, start_s=min(0.0, requests[0].arrival_s))
    system = factory(SystemContext(loop=loop, cost=cost, config=config))
    system.prepare(requests)
    records = [RequestRecord(index=r.index, arrival_s=r.arrival_s, input_tokens=r.input_tokens,
                             output_tokens=r.output_tokens) for r in requests]
    driver = _Driver(loop, system, requests, records, config.sample_interval_s, progress)
    loop.at(requests[0].arrival_s, Priority.ARRIVAL, driver.arrive)
    loop.at(requests[0].arrival_s, Priority.SAMPLE, driver.sample)
    t0 = time.perf_counter()
    loop.run()
    wall = time.perf_counter() - t0
    unfinished = [r.index for r in records if r.rejected is None and r.finish_s != r.finish_s]
    if unfinished:
        raise RuntimeError(f"{config.system}: {len(unfinished)} requests never finished "
                           f"(first: {unfinished[:5]}); the system lost track of them")
    log.info("%s: %d requests, %d events in %.2f s", config.system, len(records), loop.events,
             wall)
    return SimResult(config=config, records=records, summary=summarize(records),
                     timeseries=driver.series, extra=system.extra(), events=loop.events,
                     wall_s=wall, sim_end_s=loop.now)
