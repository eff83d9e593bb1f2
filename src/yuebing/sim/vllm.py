"""The coupled vLLM-like baselines of paper §5.1: ``vllm``, ``vllm_prefix_caching``,
``vllm_chunked_prefill`` (`VllmOptions`), run through the simulator runner
(``SimConfig(system="vllm", ...)``) or `simulate_vllm`.

A load balancer in front of ``prefill_nodes + decode_nodes`` instances (`VllmSystem`) sends each
request to the one with the fewest outstanding prompt tokens; the instance
(`sim.vllm_instance.CoupledInstance`) prefills and decodes it. No KV transfer and no rejection,
except a request whose KV could never fit in one node's HBM (``kv_capacity``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from yuebing.conductor.policy.types import RejectStage
from yuebing.core.config import require
from yuebing.sim.hardware import CostModel
from yuebing.sim.metrics import RequestRecord
from yuebing.sim.system import SYSTEMS, SimConfig, SimSystem, SystemContext
from yuebing.sim.vllm_cost import CoupledCost
from yuebing.sim.vllm_instance import CoupledInstance, CoupledJob
from yuebing.sim.workload import SimRequest


@dataclass(frozen=True)
class VllmOptions:
    """Engine features of one coupled baseline.

    ``vllm``: prefill priority, prefill-only steps; ``vllm_prefix_caching``: + a local HBM LRU
    prefix cache per instance; ``vllm_chunked_prefill``: + a per-iteration token budget with mixed
    prefill/decode batches (vLLM 0.5's default budget of 512 tokens)."""

    prefix_caching: bool = field(default=False, metadata={
        "help": "reuse cached prompt blocks from the instance's HBM (LRU)"})
    chunked_prefill: bool = field(default=False, metadata={
        "help": "mixed prefill/decode iterations under a token budget"})
    max_num_batched_tokens: int = field(default=0, metadata={
        "help": "tokens per iteration (0: 512 with chunked prefill, else 131072, the model's "
                "maximum length, as vLLM 0.5 defaults)"})
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in flight"})
    cached_attention_efficiency: float = field(default=1.0, metadata={
        "help": "speed of attention over already-cached KV relative to the rest of the pass "
                "(1: same; lower models vLLM 0.5's Triton prefix-prefill kernel; sensitivity "
                "runs only)"})

    def __post_init__(self) -> None:
        require(self.max_num_batched_tokens >= 0,
                f"max_num_batched_tokens must be >= 0 (0: default), got "
                f"{self.max_num_batched_tokens}")
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(0 < self.cached_attention_efficiency <= 1,
                f"cached_attention_efficiency must be in (0, 1], got "
                f"{self.cached_attention_efficiency}")
        require(not self.chunked_prefill or self.budget > self.max_num_seqs,
                f"with chunked prefill max_num_batched_tokens ({self.budget}) must exceed "
                f"max_num_seqs ({self.max_num_seqs}) so prompts can make progress")

    @property
    def budget(self) -> int:
        """The effective per-iteration token budget."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return 512 if self.chunked_prefill else 131_072


VARIANTS: Mapping[str, VllmOptions] = MappingProxyType({
    "vllm": VllmOptions(),
    "vllm_prefix_caching": VllmOptions(prefix_caching=True),
    "vllm_chunked_prefill": VllmOptions(chunked_prefill=True),
})
"""The paper's three baselines (Figure 1 names)."""


class VllmSystem(SimSystem):
    """``prefill_nodes + decode_nodes`` coupled instances behind a least-work load balancer."""

    def __init__(self, ctx: SystemContext, options: VllmOptions) -> None:
        super().__init__(ctx)
        self.options = options
        cfg = self.config
        n = cfg.prefill_nodes + cfg.decode_nodes
        step_cost = CoupledCost(self.cost, options.cached_attention_efficiency)
        self.capacity = self.cost.decode_kv_capacity_tokens
        self.instances = [
            CoupledInstance(f"n{i}", self.loop, step_cost, self.capacity, cfg.policy.block_tokens,
                            options.prefix_caching, options.chunked_prefill, options.budget,
                            options.max_num_seqs)
            for i in range(n)]

    def _pick(self) -> CoupledInstance:
        best = self.instances[0]
        best_key = (best.outstanding_tokens, best.running)
        for inst in self.instances[1:]:
            key = (inst.outstanding_tokens, inst.running)
            if key < best_key:
                best, best_key = inst, key
        return best

    def on_arrival(self, request: SimRequest, record: RequestRecord) -> None:
        if request.input_tokens + request.output_tokens > self.capacity:
            record.rejected = RejectStage.ARRIVAL
            record.reject_reason = "kv_capacity"
            return
        self._pick().submit(CoupledJob(request, record))

    def load(self) -> dict[str, float]:
        n = len(self.instances)
        return {
            "prefill_queued": float(sum(len(i.waiting) + len(i.prefilling)
                                        for i in self.instances)),
            "prefill_outstanding_tokens": sum(i.outstanding_tokens for i in self.instances) / n,
            "decode_batch": sum(i.running for i in self.instances) / n,
            "decode_load": sum(i.kv_reserved for i in self.instances) / n / self.capacity,
        }

    def extra(self) -> dict[str, object]:
        return {"instances": len(self.instances),
                "options": dataclasses.asdict(self.options) | {"budget": self.options.budget},
                "cache_evictions": sum(i.cache_evictions for i in self.instances)}


def _factory(options: VllmOptions) -> Callable[[SystemContext], SimSystem]:
    def build(ctx: SystemContext) -> SimSystem:
        return VllmSystem(ctx, options)

    return build


for _name, _options in VARIANTS.items():
    SYSTEMS.add(_name, _factory(_options))


def register_variant(name: str, options: VllmOptions) -> None:
    """Register a coupled baseline with other `VllmOptions` as system ``name`` (sensitivity
    runs, e.g. ``benchmarks/vllm_baselines.py``); the paper's three are registered at import.
    A name already taken raises the registry's error."""
    SYSTEMS.add(name, _factory(options))


def simulate_vllm(requests: Sequence[SimRequest], config: SimConfig, variant: str,
                  cost: CostModel | None = None,
                  progress: Callable[[int], None] | None = None) -> list[RequestRecord]:
    """Replay ``requests`` through the baseline ``variant`` (a `VARIANTS` name) on
    ``config.prefill_nodes + config.decode_nodes`` coupled instances; the per-request records."""
    from yuebing.sim.runner import simulate

    require(variant in VARIANTS, f"unknown vLLM variant {variant!r}; use one of "
            f"{', '.join(VARIANTS)}")
    return simulate(requests, dataclasses.replace(config, system=variant), cost,
                    progress).records
