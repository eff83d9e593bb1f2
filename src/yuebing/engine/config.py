"""Configuration of the inference engine: the model's shape and the runtime's knobs.

`ModelConfig` is read from the model files (GGUF metadata, ``config.json``) or given for dummy
weights; `EngineConfig` is what an operator sets (model path, KV blocks, batching budget, dtype,
device, threads, attention paths, native or torch kernels). Both are frozen and validated on construction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from yuebing.core.config import require
from yuebing.core.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION = ("auto", "grouped", "sdpa", "paged")
KERNELS = ("auto", "native", "torch")
PREFILL_ATTENTION = ("same", "auto", "grouped", "sdpa", "blas", "flash", "flash_amx")
MAX_BLOCKS = 2**31 - 1
"""Most KV blocks of one pool: block tables are int32."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``kind`` is ``none``, ``linear`` or ``llama3``."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        require(self.kind in ("none", "linear", "llama3"),
                f"rope scaling {self.kind!r} is not supported; use none, linear or llama3")
        require(self.factor > 0, f"rope scaling factor must be > 0, got {self.factor}")
        require(self.high_freq_factor > self.low_freq_factor > 0,
                "rope scaling needs high_freq_factor > low_freq_factor > 0")
        require(self.original_max_position > 0, "original_max_position must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a LLaMA-family decoder (Llama, SmolLM, Qwen2)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position: int = 8192
    tie_embeddings: bool = True
    qkv_bias: bool = False
    name: str = "llama"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "intermediate_size", "max_position"):
            require(getattr(self, f) > 0, f"model {f} must be > 0, got {getattr(self, f)}")
        require(self.num_heads % self.num_kv_heads == 0,
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim == 0:
            require(self.hidden_size % self.num_heads == 0,
                    f"hidden_size ({self.hidden_size}) must divide by num_heads "
                    f"({self.num_heads}) or head_dim must be given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        require(self.head_dim > 0 and self.head_dim % 2 == 0,
                f"head_dim must be a positive even number, got {self.head_dim}")
        require(self.rms_norm_eps > 0, "rms_norm_eps must be > 0")
        require(self.rope_theta > 0, "rope_theta must be > 0")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers at 2 bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def num_params(self) -> int:
        d, h = self.hidden_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * d * self.intermediate_size
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * d) + emb + d


def default_threads() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def parse_layers(text: str, num_layers: int | None) -> tuple[int, int]:
    """``"A:B"`` → (A, B), a non-empty half-open range of layers, within ``num_layers`` when
    given; ``""`` → every layer (needs ``num_layers``). Raises `ConfigError` naming the range."""
    if not text:
        if num_layers is None:
            raise ConfigError("layers: an empty range needs the model's layer count")
        return 0, num_layers
    a, sep, b = text.partition(":")
    if not (sep and a.strip().isdigit() and b.strip().isdigit()):
        raise ConfigError(f"layers {text!r} is not a range A:B of layer numbers, e.g. 0:15")
    lo, hi = int(a), int(b)
    if lo >= hi:
        raise ConfigError(f"layers {text!r} is empty: A must be below B")
    if num_layers is not None and hi > num_layers:
        raise ConfigError(f"layers {text!r} reach past the model's {num_layers} layers "
                          f"(0:{num_layers})")
    return lo, hi


def parse_group_layers(texts: list[str], num_layers: int | None) -> list[tuple[int, int]]:
    """The ranges of a pipeline group's stages, in order: they must tile the model's layers,
    ``0:a, a:b, ..., y:num_layers``. Raises `ConfigError` naming the ranges (overlap, gap,
    not starting at 0 or not ending at the model's last layer)."""
    ranges = [parse_layers(t, num_layers) for t in texts]
    named = ", ".join(texts)
    if not ranges:
        raise ConfigError("a pipeline group needs at least one layer range")
    if ranges[0][0] != 0:
        raise ConfigError(f"layer ranges {named} must start at layer 0")
    for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
        if lo < hi:
            raise ConfigError(f"layer ranges {named} overlap at {lo}:{hi}")
        if lo > hi:
            raise ConfigError(f"layer ranges {named} leave a gap at {hi}:{lo}")
    if num_layers is not None and ranges[-1][1] != num_layers:
        raise ConfigError(f"layer ranges {named} end at layer {ranges[-1][1]}, not at the "
                          f"model's {num_layers}")
    return ranges


@dataclass(frozen=True)
class EngineConfig:
    """Runtime knobs of one engine instance."""

    model: str = field(default="smollm2", metadata={"help": "model: smollm2 (bundled GGUF), a "
                       ".gguf file, a Hugging Face safetensors directory, or dummy[:k=v,...]"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_blocks: int = field(default=0, metadata={
        "help": "KV blocks in the pool; 0 sizes it from kv_cache_bytes"})
    kv_cache_bytes: int = field(default=1 << 30, metadata={
        "help": "KV pool size when num_blocks is 0", "size": True})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one batch"})
    max_batch_tokens: int = field(default=512, metadata={
        "help": "token budget of one step (chunked prefill splits longer prompts)"})
    max_model_len: int = field(default=0, metadata={
        "help": "longest sequence (prompt + output); 0 = the model's context length"})
    mixed_batches: bool = field(default=True, metadata={
        "help": "mix prefill chunks and decode tokens in one step (coupled baseline)"})
    mixed_step_s: float = field(default=0.09, metadata={
        "help": "longest step a prefill chunk may make beside running decodes, in seconds: the "
                "chunk is sized from the measured cost per token of recent prefill steps, so "
                "the decodes' time between tokens stays inside a TBT SLO (0.09 s: inside the "
                "default 100 ms SLO; CPU engines); 0 = chunks take the whole --max-batch-tokens"})
    prefix_caching: bool = field(default=True, metadata={"help": "reuse cached full KV blocks"})
    dtype: str = field(default="auto", metadata={
        "help": "auto (bf16 on CPUs with bf16 support and on CUDA), float32, bfloat16, float16"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads; 0 = auto (1 or all usable cores, measured at start-up)"})
    attention: str = field(default="auto", metadata={
        "help": "attention path for decode and prefill: grouped (matmuls over gathered "
                "blocks), sdpa, paged (native decode kernel over the block table; prefill "
                "then measured), or auto (each measured at start-up)"})
    kernels: str = field(default="auto", metadata={
        "help": "per-layer small ops and the paged decode kernel: native (C++ built on first "
                "use; fails if it cannot be built), torch, or auto (native on CPU when it "
                "builds, else torch)"})
    prefill_attention: str = field(default="same", metadata={
        "help": "prefill attention path: same (as --attention), auto (measured), grouped, "
                "sdpa, blas (MKL bf16 GEMM with fp32 scores; bf16 on x86-64 CPUs), flash (native "
                "kernel; bf16 CPU) or flash_amx (its AMX-tile build; CPUs with AMX-BF16)"})
    weights_seed: int = field(default=0, metadata={"help": "seed of dummy random weights"})
    packed_weights: bool = field(default=True, metadata={
        "help": "pack matmul weights into oneDNN's layout once at load (CPU; prefill row "
                "counts where torch.mm timed faster at start-up still take it)"})
    amx_linear: bool = field(default=True, metadata={
        "help": "prefill projections may run the native AMX linear where it timed faster at "
                "start-up (bf16, native kernels, CPUs with AMX-BF16, not batch-invariant); "
                "false: oneDNN / torch.mm only"})
    fused_decode: int = field(default=-1, metadata={
        "help": "decode-only steps of at most N sequences run each layer as one native op "
                "(bf16 with AVX512-BF16, native kernels, not batch-invariant): -1 = measured at "
                "start-up against the op-by-op path, 0 = off, 1..16 = N (above 8 only on AMX "
                "tiles)"})
    layers: str = field(default="", metadata={
        "help": "run only layers A:B of the model (half-open, 0-based): a stage of a chunked "
                "pipeline parallel prefill group; the first stage embeds, the last computes the "
                "logits; '' = every layer"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "outputs do not depend on what else is batched, on chunking, prefix hits or "
                "preemption: every token attends alone to its own context in one fixed-order "
                "kernel (native paged, else a torch loop); needs attention auto or paged and "
                "prefill_attention same or auto. Opt-in: it costs long prefills several times "
                "their time (docs/engine.md, determinism; docs/benchmarks.md)"})

    def __post_init__(self) -> None:
        require(bool(self.model), "model must name a model (smollm2, a path, or dummy)")
        if self.layers:
            parse_layers(self.layers, None)
        require(1 <= self.block_size <= 4096, f"block_size must be in 1..4096, got {self.block_size}")
        require(0 <= self.num_blocks <= MAX_BLOCKS,
                f"num_blocks must be in 0..{MAX_BLOCKS} (block ids are int32), got "
                f"{self.num_blocks}")
        require(self.kv_cache_bytes > 0, "kv_cache_bytes must be > 0")
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(self.mixed_step_s >= 0,
                f"mixed_step_s must be >= 0 (0 = off), got {self.mixed_step_s}")
        require(self.max_batch_tokens >= 1,
                f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        require(self.max_batch_tokens >= self.max_num_seqs or not self.mixed_batches,
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode in a mixed step")
        require(self.max_model_len >= 0, "max_model_len must be >= 0")
        require(self.dtype in DTYPES, f"dtype {self.dtype!r} unknown; use one of {DTYPES}")
        require(self.device in DEVICES, f"device {self.device!r} unknown; use one of {DEVICES}")
        require(0 <= self.threads <= 4096, f"threads must be in 0..4096, got {self.threads}")
        require(0 <= self.weights_seed < 2**63,
                f"weights_seed must be in 0..{2**63 - 1}, got {self.weights_seed}")
        require(self.attention in ATTENTION,
                f"attention {self.attention!r} unknown; use one of {ATTENTION}")
        require(-1 <= self.fused_decode <= 16,
                f"fused_decode must be -1 (measured), 0 (off) or 1..16, got {self.fused_decode}")
        require(self.kernels in KERNELS,
                f"kernels {self.kernels!r} unknown; use one of {KERNELS}")
        require(self.prefill_attention in PREFILL_ATTENTION,
                f"prefill_attention {self.prefill_attention!r} unknown; use one of "
                f"{PREFILL_ATTENTION}")
        require(not self.batch_invariant or (self.attention in ("auto", "paged") and
                                             self.prefill_attention in ("same", "auto")),
                f"batch_invariant runs one attention path for every token, so attention "
                f"{self.attention!r} / prefill_attention {self.prefill_attention!r} cannot "
                "apply; leave them at auto / same, or set batch_invariant false")
