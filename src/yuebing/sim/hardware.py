"""Hardware cost models of the simulator: how long prefill, a decode step and a transfer take.

The runner builds one `CostModel` per run — ``roofline`` (`RooflineCostModel`, the paper's
Table 1, its free choices fitted to Figure 14 by `yuebing.sim.calibrate`) or ``fitted``
(`FittedCostModel`, from a ``yuebing profile`` file) — and hands it to the simulated system;
instances ask it for durations when they start work, and the policy's predictors are fitted
from samples of it. Cost models are pure functions of their arguments.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from yuebing.conductor.policy.predictors import FORMAT as PREDICTORS_FORMAT
from yuebing.conductor.policy.predictors import (
    DecodePredictor,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
)
from yuebing.core.config import require
from yuebing.core.errors import InputError
from yuebing.core.registry import Registry


@dataclass(frozen=True)
class ModelSpec:
    """The served model (defaults: LLaMA3-70B as in the paper's Table 1)."""

    layers: int = field(default=80, metadata={"help": "transformer layers l"})
    d_model: int = field(default=8192, metadata={"help": "hidden size d"})
    flops_a: float = field(default=4.0, metadata={"help": "attention FLOPs coefficient a"})
    flops_b: float = field(default=22.0, metadata={"help": "linear FLOPs coefficient b"})
    params: float = field(default=70e9, metadata={"help": "parameter count"})
    weight_bytes_per_param: int = field(default=2, metadata={"help": "bytes per weight (bf16: 2)"})
    kv_bytes_per_token: int = field(default=327_680, metadata={
        "help": "KV bytes per token over all layers (80 layers · 8 KV heads · 128 · 2 · 2 B)"})

    def __post_init__(self) -> None:
        require(self.layers > 0 and self.d_model > 0, "model layers and d_model must be > 0")
        require(self.flops_a >= 0 and self.flops_b > 0, "flops_a must be >= 0 and flops_b > 0")
        require(self.params > 0, "model params must be > 0")
        require(self.weight_bytes_per_param > 0, "weight_bytes_per_param must be > 0")
        require(self.kv_bytes_per_token > 0, "kv_bytes_per_token must be > 0")

    @property
    def weight_bytes(self) -> float:
        return self.params * self.weight_bytes_per_param

    def flops(self, tokens: float) -> float:
        """Paper Table 1: FLOPs(n) = l·(a·n²·d + b·n·d²) for a prefill of ``n`` tokens."""
        d = self.d_model
        return self.layers * (self.flops_a * tokens * tokens * d + self.flops_b * tokens * d * d)

    def linear_flops(self, new_tokens: float) -> float:
        """The linear (weight-matmul) part of FLOPs(c+n) − FLOPs(c): l·b·n·d²."""
        return self.layers * self.flops_b * new_tokens * self.d_model * self.d_model

    def attention_flops(self, new_tokens: float, cached_tokens: float) -> float:
        """The attention part of FLOPs(c+n) − FLOPs(c): l·a·d·(n² + 2·n·c) (Table 1's count,
        every query-key pair of a causal pass counted twice)."""
        n, c = new_tokens, cached_tokens
        return self.layers * self.flops_a * self.d_model * (n * n + 2.0 * n * c)


@dataclass(frozen=True)
class NodeSpec:
    """One serving node (defaults: 8×A800 80GB, paper §5 / Table 1)."""

    gpus: int = field(default=8, metadata={"help": "GPUs per node"})
    gpu_flops: float = field(default=312e12, metadata={"help": "peak bf16 FLOP/s per GPU"})
    mfu: float = field(default=0.466, metadata={
        "help": "asymptotic FLOPs utilisation of a large forward pass's linear layers "
                "(fitted to the paper's Figure 14)"})
    mfu_half_tokens: int = field(default=256, metadata={
        "help": "tokens in a forward pass at which the linear layers' MFU is half of mfu "
                "(mfu(t) = mfu · t / (t + mfu_half_tokens); 0: flat mfu)"})
    attention_mfu: float = field(default=0.601, metadata={
        "help": "FLOPs utilisation of prefill attention over the FLOPs a causal kernel computes "
                "(half of Table 1's attention count; fitted to Figure 14)"})
    prefill_overhead_s: float = field(default=0.116, metadata={
        "help": "fixed cost of scheduling one prefill request (fitted to Figure 14)"})
    decode_mfu: float = field(default=0.3, metadata={"help": "decode matmul FLOPs utilisation"})
    hbm_Bps: float = field(default=2.039e12, metadata={"help": "HBM bandwidth per GPU, B/s"})
    mbu: float = field(default=0.445, metadata={
        "help": "decode memory-bandwidth utilisation (fitted to Figure 14)"})
    hbm_bytes: float = field(default=80e9, metadata={"help": "HBM capacity per GPU, bytes"})
    hbm_usable: float = field(default=0.9, metadata={"help": "share of HBM usable for weights+KV"})
    h2d_Bps: float = field(default=128e9, metadata={"help": "host<->device bandwidth, B/s"})
    nic_Bps: float = field(default=100e9, metadata={"help": "node NIC bandwidth (4×200 Gbps), B/s"})
    nic_latency_s: float = field(default=50e-6, metadata={"help": "per-transfer latency, s"})
    chunk_tokens: int = field(default=8192, metadata={"help": "chunked-prefill chunk size"})
    chunk_overhead_s: float = field(default=0.01, metadata={"help": "fixed cost per prefill chunk"})
    step_overhead_s: float = field(default=0.0069, metadata={
        "help": "fixed cost per decode step (fitted to Figure 14)"})
    seq_overhead_s: float = field(default=0.0004, metadata={
        "help": "decode cost per sequence in the batch (sampling, attention launch, scheduling)"})

    def __post_init__(self) -> None:
        require(self.gpus > 0, "gpus must be > 0")
        for name in ("gpu_flops", "hbm_Bps", "hbm_bytes", "h2d_Bps", "nic_Bps"):
            require(getattr(self, name) > 0, f"{name} must be > 0")
        for name in ("mfu", "attention_mfu", "decode_mfu", "mbu", "hbm_usable"):
            require(0 < getattr(self, name) <= 1, f"{name} must be in (0, 1]")
        require(self.chunk_tokens > 0, "chunk_tokens must be > 0")
        require(self.mfu_half_tokens >= 0, "mfu_half_tokens must be >= 0 (0: flat mfu)")
        for name in ("nic_latency_s", "chunk_overhead_s", "step_overhead_s", "seq_overhead_s",
                     "prefill_overhead_s"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0")


class CostModel(ABC):
    """Durations of simulated work. Called by simulated instances (single simulation thread)
    whenever they start a prefill, a decode step or a transfer, and by the runner to sample
    training points for the policy predictors. Implementations are pure (no side effects)."""

    kv_bytes_per_token: int
    """KV bytes one token occupies (all layers)."""
    decode_kv_capacity_tokens: int
    """KV tokens that fit in one decode node's HBM next to the weights."""
    link_Bps: float
    link_latency_s: float
    prefill_chunk_tokens: int = 8192
    """Chunk size of chunked prefill (also the pipeline stage unit of CPP)."""

    @abstractmethod
    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds one node needs to prefill ``new_tokens`` after ``cached_tokens`` reused ones."""

    @abstractmethod
    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        """Seconds of one decode iteration of ``batch_size`` requests holding ``context_tokens``."""

    def cache_load_time(self, cached_tokens: int) -> float:
        """Of `prefill_time`, the seconds spent loading ``cached_tokens`` of reused KV into
        HBM before computing (0 where the model does not separate it)."""
        return 0.0

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` between two nodes (0 bytes: free)."""
        if nbytes <= 0:
            return 0.0
        return self.link_latency_s + nbytes / self.link_Bps


COST_MODELS: Registry[type[CostModel]] = Registry("cost model")
SAMPLES_FORMAT = "yuebing-profile-samples"
"""Format tag of the raw profiling samples written by ``yuebing profile --samples``."""


@COST_MODELS.register("roofline")
class RooflineCostModel(CostModel):
    """Analytic roofline from the paper's Table 1 (see the module docstring).

    - prefill of ``n`` new tokens after ``c`` cached costs FLOPs(c+n) − FLOPs(c), FLOPs(x) =
      l·(a·x²·d + b·x·d²), chunk by chunk (``chunk_tokens``). The linear part of a pass over ``t``
      tokens runs at ``gpus · gpu_flops · mfu(t)``, ``mfu(t) = mfu · t / (t + mfu_half_tokens)``
      (small passes use the GPUs far worse; every system uses this one curve). The attention part
      l·a·d·(n² + 2·n·c) runs half those FLOPs (a causal kernel) at ``attention_mfu``. Time =
      ``prefill_overhead_s`` + loading the cached prefix over the host link (``h2d_Bps``) +
      max(compute, storing the new KV layer by layer) + ``chunk_overhead_s`` per chunk;
    - a decode step reads the weights and the batch's KV once: bytes / (HBM bandwidth · mbu), or
      the batch's matmul FLOPs if larger, plus ``step_overhead_s`` and ``seq_overhead_s`` per
      sequence;
    - a transfer of ``B`` bytes takes ``nic_latency_s + B / nic_Bps``."""

    def __init__(self, model: ModelSpec | None = None, node: NodeSpec | None = None) -> None:
        self.model = model or ModelSpec()
        self.node = node or NodeSpec()
        n, m = self.node, self.model
        self._peak = n.gpus * n.gpu_flops
        self._hbm_rate = n.gpus * n.hbm_Bps * n.mbu
        self.kv_bytes_per_token = m.kv_bytes_per_token
        kv_bytes = n.gpus * n.hbm_bytes * n.hbm_usable - m.weight_bytes
        require(kv_bytes > 0, "the model weights do not fit in the node's usable HBM; "
                "raise gpus / hbm_bytes / hbm_usable")
        self.decode_kv_capacity_tokens = int(kv_bytes // m.kv_bytes_per_token)
        self.link_Bps = n.nic_Bps
        self.link_latency_s = n.nic_latency_s
        self.prefill_chunk_tokens = n.chunk_tokens
        # decode step = max(_w + ctx·_kv, batch·_mm) + step_overhead + batch·seq_overhead
        self._w = m.weight_bytes / self._hbm_rate
        self._kv = m.kv_bytes_per_token / self._hbm_rate
        self._mm = 2.0 * m.params / (self._peak * n.decode_mfu)
        self.attention_scale = 0.5 / (self._peak * n.attention_mfu)
        """Seconds per attention FLOP of Table 1's count (a causal kernel computes half of
        them, at ``attention_mfu``)."""

    def efficiency(self, tokens: int) -> float:
        """FLOPs utilisation of the linear layers in one forward pass over ``tokens`` tokens
        (the curve of the module docstring)."""
        half = self.node.mfu_half_tokens
        return self.node.mfu * tokens / (tokens + half) if half else self.node.mfu

    def pass_compute_time(self, parts: Sequence[tuple[int, int]], extra_tokens: int = 0,
                          cached_attention_slowdown: float = 0.0) -> float:
        """Seconds of compute of one forward pass over prompt ``parts`` = [(new, cached), ...]
        whose linear layers also carry ``extra_tokens`` (a mixed step's decode tokens, whose
        own FLOPs the caller counts elsewhere). ``cached_attention_slowdown`` s adds s times
        the cost of attending to earlier KV (the n·c pairs; coupled-engine sensitivity runs)."""
        m = self.model
        tokens = max(sum(n for n, _ in parts) + extra_tokens, 1)
        linear = sum(m.linear_flops(n) for n, _ in parts) / (self._peak * self.efficiency(tokens))
        attention = sum(m.attention_flops(n, c) for n, c in parts)
        if cached_attention_slowdown:
            attention += cached_attention_slowdown * sum(
                m.attention_flops(n, c) - m.attention_flops(n, 0) for n, c in parts)
        return linear + attention * self.attention_scale

    def prefill_compute_time(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds of compute of a prefill chunked into passes of ``chunk_tokens``: every full
        chunk's linear layers at efficiency(chunk), the tail's at efficiency(tail); the
        attention of all chunks together is the attention of the whole prefill."""
        m, size = self.model, self.node.chunk_tokens
        full, rest = divmod(new_tokens, size)
        linear = full * m.linear_flops(size) / (self._peak * self.efficiency(size)) if full \
            else 0.0
        if rest:
            linear += m.linear_flops(rest) / (self._peak * self.efficiency(rest))
        return linear + m.attention_flops(new_tokens, cached_tokens) * self.attention_scale

    def cache_load_time(self, cached_tokens: int) -> float:
        return cached_tokens * self.model.kv_bytes_per_token / self.node.h2d_Bps

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        n = self.node
        compute = self.prefill_compute_time(new_tokens, cached_tokens)
        store = new_tokens * self.model.kv_bytes_per_token / n.h2d_Bps
        chunks = math.ceil(new_tokens / n.chunk_tokens)
        return (n.prefill_overhead_s + self.cache_load_time(cached_tokens)
                + max(compute, store) + chunks * n.chunk_overhead_s)

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        memory = self._w + context_tokens * self._kv
        compute = batch_size * self._mm
        n = self.node
        return ((memory if memory > compute else compute) + n.step_overhead_s
                + batch_size * n.seq_overhead_s)


class _PrefillSample(msgspec.Struct):
    new_tokens: int
    cached_tokens: int
    seconds: float


class _DecodeSample(msgspec.Struct):
    batch: int
    context_tokens: int
    seconds: float


class _ProfileSamples(msgspec.Struct):
    """The raw-samples file ``yuebing profile --samples`` writes (``yuebing-profile-samples``);
    only the fields the simulator needs."""

    format: str
    version: int
    prefill: list[_PrefillSample]
    decode: list[_DecodeSample]


@COST_MODELS.register("fitted")
class FittedCostModel(CostModel):
    """Durations from the shared latency predictors (`yuebing.conductor.policy.predictors`),
    i.e. from profiling the real engine: prefill a degree-2 polynomial of (new, cached tokens),
    decode a polynomial of (batch, context tokens), transfer ``overhead + latency + bytes /
    (bandwidth · efficiency)``; the chunk (`prefill_chunk_tokens`, a pipeline stage's unit) is
    the profiled engine's ``max_batch_tokens``, and a longer prefill is timed as the engine runs
    it: chunk after chunk, each on top of the ones before (the polynomial, fitted on chunk-sized
    samples, is never extrapolated to the whole prompt). KV size per token and the decode KV
    capacity are not in the profile; they default to the Table 1 model on one 8×A800 node (the
    roofline's values)."""

    def __init__(self, predictors: Predictors, kv_bytes_per_token: int | None = None,
                 decode_kv_capacity_tokens: int | None = None, link_Bps: float = 100e9,
                 link_latency_s: float = 50e-6) -> None:
        ref = RooflineCostModel()
        self.predictors = predictors
        self.kv_bytes_per_token = kv_bytes_per_token or ref.kv_bytes_per_token
        self.decode_kv_capacity_tokens = (decode_kv_capacity_tokens
                                          or ref.decode_kv_capacity_tokens)
        require(self.kv_bytes_per_token > 0 and self.decode_kv_capacity_tokens > 0,
                "kv_bytes_per_token and decode_kv_capacity_tokens must be > 0")
        require(link_Bps > 0 and link_latency_s >= 0,
                "link_Bps must be > 0 and link_latency_s >= 0")
        self.link_Bps = link_Bps
        self.link_latency_s = link_latency_s
        self._prefill = predictors.prefill.predict
        self._decode = predictors.decode.predict
        self._engine_chunk = 0
        chunk = predictors.configuration.get("max_batch_tokens", "")
        if chunk.isdigit() and int(chunk) > 0:  # the profiled engine's chunk: a CPP stage's
            self.prefill_chunk_tokens = self._engine_chunk = int(chunk)

    @classmethod
    def from_file(cls, path: str | Path) -> FittedCostModel:
        """Load a predictor file (``yuebing profile --out``) or a raw-samples file
        (``--samples``, fitted here with the same predictor classes); a missing or malformed
        file raises `InputError` naming it and the problem."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise InputError(f"cannot read profile {p}: {e.strerror}") from None
        try:
            fmt = msgspec.json.decode(raw, type=dict).get("format")
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise InputError(f"{p}: invalid profile: not a JSON object ({e})") from None
        if fmt == PREDICTORS_FORMAT:
            return cls(Predictors.from_json(raw, origin=str(p)))
        if fmt != SAMPLES_FORMAT:
            raise InputError(f"{p}: invalid profile: format {fmt!r} is neither "
                             f"{PREDICTORS_FORMAT!r} nor {SAMPLES_FORMAT!r}")
        try:
            samples = msgspec.json.decode(raw, type=_ProfileSamples)
        except msgspec.ValidationError as e:
            raise InputError(f"{p}: invalid profile: {e}") from None
        return cls(Predictors(
            PrefillPredictor.fit([(s.new_tokens, s.cached_tokens, s.seconds)
                                  for s in samples.prefill]),
            DecodePredictor.fit([(s.batch, s.context_tokens, s.seconds) for s in samples.decode]),
            TransferPredictor(), source=f"fitted from {p}"))

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        chunk = self._engine_chunk
        if not chunk or new_tokens <= chunk:
            return self._prefill(new_tokens, cached_tokens)
        whole, rest = divmod(new_tokens, chunk)
        t = sum(self._prefill(chunk, cached_tokens + i * chunk) for i in range(whole))
        return t + (self._prefill(rest, cached_tokens + whole * chunk) if rest else 0.0)

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self._decode(batch_size, context_tokens)

    def transfer_time(self, nbytes: float) -> float:
        return self.predictors.transfer.predict(nbytes, self.link_Bps, self.link_latency_s)
