"""Shared fakes of the simulator tests (tests/sim is on sys.path in pytest's rootdir mode)."""

from __future__ import annotations

from yuebing.sim.hardware import CostModel


class LinearCost(CostModel):
    """Prefill 1 ms per new token, decode 50 ms per iteration, 1 kB of KV per token, 1 GB/s."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self.kv_bytes_per_token = 1000
        self.decode_kv_capacity_tokens = capacity
        self.link_Bps = 1e9
        self.link_latency_s = 0.0

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        return 1e-3 * new_tokens

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        return 0.05 if batch_size else 0.0
