"""What a simulated serving system is, and the configuration of one simulation run.

Life cycle: the runner (`yuebing.sim.runner.simulate`) looks the system up by
``SimConfig.system`` in `SYSTEMS`, builds it with a `SystemContext` (event loop, cost model,
config), then for each trace request at its arrival time calls `SimSystem.on_arrival` with a
fresh `RequestRecord`; the system schedules its own events and fills in the record. Every
``sample_interval_s`` the runner calls `SimSystem.load` for the load time series; at the end
it calls `SimSystem.extra` for system-specific outputs (e.g. hot-key replica counts).

Systems: ``mooncake`` (`yuebing.sim.mooncake`) and the coupled vLLM-like baselines
(`yuebing.sim.vllm`) register themselves here on import.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from yuebing.conductor.policy.config import PolicyConfig
from yuebing.core.config import require
from yuebing.core.registry import Registry
from yuebing.sim.hardware import CostModel
from yuebing.sim.loop import EventLoop
from yuebing.sim.metrics import RequestRecord
from yuebing.sim.workload import SimRequest

SIM_POLICY = PolicyConfig(prefill_selector="global_cache_aware", decode_selector="least_loaded",
                          admission="none", prefill_queue="fifo", block_tokens=512,
                          ttft_slo_s=30.0, tbt_slo_s=0.1, kvcache_balancing_threshold=1.3,
                          cpp_threshold_tokens=65_536, cpp_max_nodes=4, seed=0)
"""A run's policy unless told otherwise: the paper's (Algorithm 1, FIFO prefill queues, the
trace's 512-token blocks, TTFT 30 s / TBT 100 ms); the live Conductor's queue default differs."""
POLICY_FLAGS = ("prefill_selector", "decode_selector", "admission", "prefill_queue",
                "prefill_queue_aging", "block_tokens", "kvcache_balancing_threshold",
                "ttft_slo_s", "tbt_slo_s", "tbt_tail", "forecast_hold", "cpp_threshold_tokens",
                "cpp_max_nodes", "seed")
"""The `PolicyConfig` fields ``yuebing sim run`` offers as its own flags."""


def sim_policy(**changes: object) -> PolicyConfig:
    """`SIM_POLICY` with ``changes`` (field names of `PolicyConfig`)."""
    return dataclasses.replace(SIM_POLICY, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SimConfig:
    """One simulation run: which system, how many nodes, which policies, which workload."""

    system: str = field(default="mooncake", metadata={
        "help": "system to simulate: mooncake, vllm, vllm_prefix_caching, vllm_chunked_prefill"})
    prefill_nodes: int = field(default=8, metadata={
        "help": "prefill nodes (coupled baselines use prefill_nodes + decode_nodes instances; 0 with cpp_twins: the twins are the single nodes)"})
    decode_nodes: int = field(default=8, metadata={"help": "decode nodes"})
    policy: PolicyConfig = field(default_factory=lambda: SIM_POLICY, metadata={
        "flags": POLICY_FLAGS})
    """The shared Conductor policy's configuration (selectors, admission, queue order, SLOs,
    block size, CPP, seed); `predict.policy_config` adds what the run's cost model decides."""
    cost_model: str = field(default="roofline", metadata={"help": "roofline or fitted"})
    profile: str = field(default="", metadata={
        "help": "predictor or samples JSON written by yuebing profile (fitted cost model)"})
    speed: float = field(default=1.0, metadata={"help": "trace replay speed (2 = twice as fast)"})
    limit: int = field(default=0, metadata={"help": "replay only the first N requests (0: all)"})
    output_tokens: int = field(default=0, metadata={
        "help": "give every request this many output tokens (0: the trace's own)"})
    cpp_groups: int = field(default=0, metadata={
        "help": "mooncake: declared pipeline groups of cpp_group_stages dedicated stage nodes "
                "each, beside the prefill nodes (as live stage instances: a node of a group "
                "holds a layer range and prefills only with its group; 0: none, long prefills "
                "form groups of any prefill nodes)"})
    cpp_group_stages: int = field(default=2, metadata={"help": "stages per declared group"})
    cpp_twins: bool = field(default=False, metadata={
        "help": "mooncake with cpp_groups: a whole-model twin prefill node beside each stage "
                "(live: --twin-of): it prefills short prompts while its group is idle, and "
                "the group waits for its work"})
    dram_kv_tokens: int = field(default=2_000_000, metadata={
        "help": "KV tokens each node's DRAM pool holds (LRU)"})
    prefill_reject: bool = field(default=False, metadata={
        "help": "reject at prefill when the request's prefill would end past its TTFT SLO"})
    decode_reject: bool = field(default=False, metadata={
        "help": "reject at decode when a request's KV arrives and cannot join the batch at once "
                "(its prefill is wasted; the overload baseline)"})
    sample_interval_s: float = field(default=10.0, metadata={
        "help": "period of load / replica samples, s"})
    colocated: bool = field(default=False, metadata={
        "help": "mooncake: prefill node i and decode node i share a host and slow each other "
                "down by the factors `yuebing profile --interference` measured "
                "(yuebing.sim.colocation; a pipeline group of prefill nodes with each of its "
                "nodes' hosts; not with cpp_groups)"})
    host_cores: int = field(default=0, metadata={
        "help": "mooncake, colocated: every node shares one host of this many cores, one engine "
                "thread each, as yuebing serve on one machine (decode cores reserved, prefills "
                "take turns on the rest: yuebing.sim.colocation.SharedHost); 0: prefill node i and decode node i pair "
                "up"})
    interference_profile: str = field(default="", metadata={
        "help": "samples file with the interference factors for colocated (default: profile)"})
    decode_tail: float = field(default=1.0, metadata={
        "help": "mooncake: the realized TBT tail of the decode steps: each step is slow with "
                "probability 1/10 (drawn per step and decode node from the run's seed, "
                "policy.seed), taking this many times its cost-model time, so a request whose "
                "slowest tenth of intervals are slow steps has a paper TBT of this times its "
                "step, as the live Conductor's TBT tail measures (`sim.decode.SlowSteps`; a live "
                "Conductor's learned tail; colocated, the slow steps take it divided by the "
                "decode factor a step beside a prefill already takes); 1: even steps (the "
                "default)"})
    forecast_durations_s: tuple[float, ...] = field(default=(), metadata={
        "help": "the decode durations (equally likely, seconds) the predictive early rejection "
                "forecast assumes, e.g. those a live Conductor learned (empty: the workload's "
                "output lengths times a loaded decode node's step, `predict.decode_durations`)"})

    def __post_init__(self) -> None:
        require(self.prefill_nodes >= 1 or self.cpp_twins,
                "prefill_nodes must be >= 1 (0 only with cpp_twins: the twins prefill alone)")
        require(self.decode_nodes >= 1, "decode_nodes must be >= 1")
        require(self.cpp_groups >= 0 and self.cpp_group_stages >= 2,
                f"cpp_groups must be >= 0 and cpp_group_stages >= 2, got {self.cpp_groups}, "
                f"{self.cpp_group_stages}")
        require(not self.cpp_twins or self.cpp_groups > 0,
                "cpp_twins needs declared pipeline groups (cpp_groups > 0)")
        require(not self.cpp_groups or self.system == "mooncake",
                f"declared pipeline groups are modelled for system mooncake only, not "
                f"{self.system!r}")
        require(math.isfinite(self.speed) and self.speed > 0,
                f"speed must be > 0 and finite, got {self.speed}")
        require(self.limit >= 0, "limit must be >= 0 (0 replays the whole trace)")
        require(self.output_tokens >= 0, "output_tokens must be >= 0 (0: the trace's own)")
        require(self.dram_kv_tokens >= self.policy.block_tokens,
                "dram_kv_tokens must hold at least one block")
        require(self.policy.cpp_threshold_tokens > 0, "cpp_threshold_tokens must be > 0")
        require(self.sample_interval_s > 0, "sample_interval_s must be > 0")
        require(self.cost_model != "fitted" or bool(self.profile),
                "cost_model 'fitted' needs --profile PATH")
        require(not self.colocated or self.system == "mooncake",
                f"colocated is modelled for system mooncake only, not {self.system!r}")
        require(self.host_cores >= 0 and (not self.host_cores or self.colocated),
                f"host_cores must be >= 0 and needs colocated, got {self.host_cores}")
        require(not (self.colocated and self.cpp_groups),
                "colocated is not modelled with declared pipeline groups (cpp_groups): their "
                "stage nodes belong to no simulated host, so they would neither slow the "
                "decodes nor wait for a core; drop one of the two")
        require(math.isfinite(self.decode_tail) and self.decode_tail >= 1.0,
                f"decode_tail must be a finite number >= 1 (1: even steps), got "
                f"{self.decode_tail}")
        require(self.decode_tail == 1.0 or self.system == "mooncake",
                f"decode_tail is modelled for system mooncake only, not {self.system!r}")
        require(all(math.isfinite(d) and d > 0 for d in self.forecast_durations_s),
                f"forecast_durations_s must be positive seconds, got {self.forecast_durations_s}")
        require(not self.colocated or bool(self.interference_profile or self.profile),
                "colocated needs the interference factors: --interference-profile PATH (the "
                "samples file of yuebing profile --interference)")


@dataclass(frozen=True)
class SystemContext:
    """What a system gets when it is built."""

    loop: EventLoop
    cost: CostModel
    config: SimConfig


class SimSystem(ABC):
    """A simulated serving system. Built and driven by the runner, single-threaded, from
    event callbacks; it mutates only its own state and the records it is given."""

    def __init__(self, ctx: SystemContext) -> None:
        self.loop = ctx.loop
        self.cost = ctx.cost
        self.config = ctx.config

    def prepare(self, requests: Sequence[SimRequest]) -> None:
        """Called once before the first arrival with the whole workload (e.g. to fit the
        policy's decode-duration distribution or pick the hot keys to follow)."""
        return None

    @abstractmethod
    def on_arrival(self, request: SimRequest, record: RequestRecord) -> None:
        """Called at ``request.arrival_s``: route or reject it and schedule its work. The
        system must eventually set ``record.rejected`` or call ``record.finish_decode``."""

    @abstractmethod
    def load(self) -> dict[str, float]:
        """Called every sample interval: current load figures (same keys every call)."""

    def extra(self) -> dict[str, object]:
        """Called once after the run: system-specific outputs for the report."""
        return {}


SYSTEMS: Registry[Callable[[SystemContext], SimSystem]] = Registry("simulated system")
"""name → factory. ``mooncake`` and the ``vllm*`` baselines register here."""
