"""Iteration durations of a coupled (vLLM-like) instance, derived from the run's `CostModel`.

Life cycle: `yuebing.sim.vllm.VllmSystem` builds one `CoupledCost` per run from the simulator's
cost model; each `yuebing.sim.vllm_instance.CoupledInstance` asks it how long its next
iteration takes: a prefill-only step, a decode-only step or a mixed (chunked-prefill) step.

With the roofline cost model (paper Table 1) the steps follow the same roofline, adapted to a
coupled engine whose prefix cache lives in HBM (no host-to-device load or store):

- prefill step over parts ``(n new, c cached)``: compute-bound, one forward pass over all the
  step's tokens (`RooflineCostModel.pass_compute_time`: the linear layers at the efficiency of
  the pass's token count — a 512-token chunk runs at 2/3 of the MFU of a long prompt — and
  the attention at the roofline's attention efficiency) plus one ``chunk_overhead_s``;
- decode step: the cost model's own `decode_step_time`;
- mixed step: an iteration is bounded below both by its decode work (weights and every KV
  token read once, per-sequence overheads: ``decode_step_time(batch, context + prompt KV)``)
  and by its prefill compute (the pass covers the chunks' tokens and one token per decoding
  sequence), and the two overlap: the maximum of the two.

``cached_attention_efficiency`` (a `VllmOptions` field, 1 by default) runs the attention of new
tokens over KV computed before this step — a cached prefix, or the earlier chunks of a chunked
prompt — at that fraction of the pass's efficiency: vLLM 0.5 computed it with its Triton
prefix-prefill kernel (``context_attention_fwd``), which its developers found slow. The
default keeps it as fast as the rest; other values are for sensitivity runs
(``benchmarks/vllm_baselines.py --cached-attention-efficiency``).

Any other cost model (e.g. ``fitted``) only exposes prefill and decode times, so a prefill step
is the sum of its parts' prefill times and a mixed step is prefill plus decode time (no overlap:
an upper bound).
"""

from __future__ import annotations

from collections.abc import Sequence

from yuebing.core.config import require
from yuebing.sim.hardware import CostModel, RooflineCostModel


class CoupledCost:
    """Durations of coupled-engine iterations (pure; one instance per run)."""

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
