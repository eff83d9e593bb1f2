"""Iteration durations of a coupled (vLLM-like) instance, derived from the run's `CostModel`.

`sim.vllm.VllmSystem` builds one `CoupledCost` per run; each `sim.vllm_instance.CoupledInstance`
asks it how long its next iteration takes: prefill-only, decode-only or mixed (chunked
prefill). With the roofline the steps follow it, adapted to a prefix cache in HBM; any other
cost model only gives prefill and decode times, so a mixed step is their sum (an upper bound).
"""

from __future__ import annotations

from collections.abc import Sequence

from yuebing.core.config import require
from yuebing.sim.hardware import CostModel, RooflineCostModel


class CoupledCost:
    """Durations of coupled-engine iterations (pure; one instance per run).

    Roofline: a prefill step over parts ``(n new, c cached)`` is one compute-bound forward pass
    over all its tokens (`RooflineCostModel.pass_compute_time`: linear layers at the pass's
    token-count efficiency — a 512-token chunk runs at 2/3 of a long prompt's MFU — attention at
    the roofline's) plus one ``chunk_overhead_s``; a decode step is the cost model's
    `decode_step_time`; a mixed step is the maximum of its decode work (weights and every KV token
    read once) and its prefill compute (the chunks' tokens plus one per decoding sequence).
    ``cached_attention_efficiency`` (`VllmOptions`, 1 by default) runs the attention of new tokens
    over earlier KV at that fraction of the pass's efficiency — vLLM 0.5's Triton prefix-prefill
    kernel was slow — for sensitivity runs (``benchmarks/vllm_baselines.py``)."""

    def __init__(self, cost: CostModel, cached_attention_efficiency: float = 1.0) -> None:
        require(0 < cached_attention_efficiency <= 1,
                f"cached_attention_efficiency must be in (0, 1], got "
                f"{cached_attention_efficiency}")
        self.cost = cost
        self._roofline = isinstance(cost, RooflineCostModel)
        self._slowdown = 1.0 / cached_attention_efficiency - 1.0
        if isinstance(cost, RooflineCostModel):
            self._overhead = cost.node.chunk_overhead_s
            self._pass = cost.pass_compute_time

    def _prefill_compute(self, parts: Sequence[tuple[int, int]], extra_tokens: int = 0) -> float:
        return self._pass(parts, extra_tokens, self._slowdown)

    def prefill_step(self, parts: Sequence[tuple[int, int]]) -> float:
        """Seconds of one prefill-only iteration over ``parts`` = [(new, cached), ...]."""
        if not self._roofline:
            return sum(self.cost.prefill_time(n, c) for n, c in parts)
        return self._prefill_compute(parts) + self._overhead

    def decode_step(self, batch_size: int, context_tokens: int) -> float:
        """Seconds of one decode-only iteration."""
        return self.cost.decode_step_time(batch_size, context_tokens)

    def mixed_step(self, parts: Sequence[tuple[int, int]], batch_size: int,
                   context_tokens: int) -> float:
        """Seconds of one iteration computing prompt ``parts`` and one token per sequence of a
        ``batch_size`` decode batch holding ``context_tokens``."""
        if not parts:
            return self.decode_step(batch_size, context_tokens)
        if not self._roofline:
            return self.prefill_step(parts) + (
                self.decode_step(batch_size, context_tokens) if batch_size else 0.0)
        kv_read = context_tokens + sum(c + n for n, c in parts)
        decode = self.decode_step(max(batch_size, 1), kv_read)
        prefill = self._prefill_compute(parts, batch_size) + self._overhead
        return decode if decode > prefill else prefill
