"""The decoder's small per-layer ops behind one seam: plain torch or native C++ kernels.

`LlamaModel.forward` calls a `KernelOps` once per layer and step for RMSNorm (residual fused),
RoPE with the K/V cache write, and SiLU(gate)·up. `resolve_kernels` picks it at start-up from
``EngineConfig.kernels``: ``torch`` (`TorchOps`, the reference), ``native`` (`NativeOps` over
``torch.ops.yuebing``; CPU; fails if it cannot be built) or ``auto``. Importing this module
also registers the native ``paged`` decode (and batch-invariant token) attention and ``flash``
prefill attention, so `choose_attention` can measure them; `NATIVE_ATTENTION` names them.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F

from yuebing.core.errors import ConfigError
from yuebing.engine import native
from yuebing.engine.attention import (
    TOKEN_IMPLS,
    AttnMetadata,
    PrefillSlice,
    register_decode,
    register_prefill,
    write_kv,
)
from yuebing.engine.config import KERNELS

log = logging.getLogger(__name__)

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernelOps(ABC):
    """Per-layer small ops; called by `LlamaModel.forward` (engine process, every step)."""

    name: str

    @abstractmethod
    def prepare_rope(self, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> Any:
        """Once per step: whatever `rope_write_kv` needs for the step's ``positions [T]``
        given the model's ``cos``/``sin`` tables ``[max_position, head_dim/2]``."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x [T, d]`` normalized and scaled by ``weight``, as a new tensor."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``; may reuse ``x`` and ``residual``'s
        storage (both belong to the forward pass)."""

    @abstractmethod
    def rope_write_kv(self, qkv: torch.Tensor, rope: Any, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttnMetadata, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor:
        """Rotate q and k of the fused ``qkv [T, (h + 2·kvh)·hd]`` projection, store k and v at
        the tokens' slots of one layer's pool; return the rotated ``q [T, h, hd]``."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [T, 2·ffn]`` (gate first) → ``[T, ffn]``."""


class TorchOps(KernelOps):
    """The reference implementation in plain torch ops (CPU and CUDA)."""

    name = "torch"

    def prepare_rope(self, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rope_write_kv(self, qkv: torch.Tensor, rope: Any, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttnMetadata, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor:
        n, hd = qkv.shape[0], k_cache.shape[-1]
        cos, sin = rope
        qk = qkv[:, : (num_heads + num_kv_heads) * hd].view(n, num_heads + num_kv_heads, hd)
        x1, x2 = qk.chunk(2, dim=-1)
        qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        v = qkv[:, (num_heads + num_kv_heads) * hd:].view(n, num_kv_heads, hd)
        write_kv(k_cache, v_cache, qk[:, num_heads:], v, meta)
        return qk[:, :num_heads]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeOps(KernelOps):
    """``torch.ops.yuebing.*`` (CPU; float32, bfloat16, float16). Needs `native.load` done."""

    name = "native"

    def __init__(self) -> None:
        self._ops = torch.ops.yuebing

    def prepare_rope(self, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return positions, cos, sin

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rope_write_kv(self, qkv: torch.Tensor, rope: Any, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttnMetadata, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor:
        positions, cos, sin = rope
        assert meta.slots is not None, "the runner sets AttnMetadata.slots"
        self._ops.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, meta.slots,
                                num_heads, num_kv_heads)
        hd = k_cache.shape[-1]
        return qkv[:, : num_heads * hd].view(qkv.shape[0], num_heads, hd)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(gate_up)


def decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttnMetadata, scale: float) -> torch.Tensor:
    """``q [D, heads, hd]`` → ``[D, heads, hd]`` by the native kernel over the block table."""
    assert meta.decode_table is not None and meta.decode_lens is not None
    return torch.ops.yuebing.paged_decode_attention(q, k_cache, v_cache, meta.decode_table,
                                                    meta.decode_lens, scale)


def _paged_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in NATIVE_DTYPES and native.available()


register_decode("paged", decode_paged, _paged_supported)


def tokens_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttnMetadata, scale: float) -> torch.Tensor:
    """Batch-invariant attention: every token of the step (decode and prefill alike) as its own
    "sequence" of the paged decode kernel, which computes each one in a fixed order (partitions
    of 512 keys merged in order) whatever else it is given."""
    assert meta.token_table is not None and meta.token_lens is not None
    return torch.ops.yuebing.paged_decode_attention(q, k_cache, v_cache, meta.token_table,
                                                    meta.token_lens, scale)


TOKEN_IMPLS["paged"] = tokens_paged


def prefill_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  sl: PrefillSlice, scale: float) -> torch.Tensor:
    """``q [n, heads, hd]`` of one sequence's chunk → ``[n, heads, hd]``: causal over the cached
    prefix plus the chunk, by the native flash kernel over the block table (bf16 only)."""
    assert sl.block_table is not None, "flash prefill needs the sequence's block table"
    return torch.ops.yuebing.flash_prefill_attention(q, k_cache, v_cache, sl.block_table,
                                                     sl.context_len, scale)


def _flash_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and native.available()


register_prefill("flash", prefill_flash, _flash_supported)


def prefill_flash_amx(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      sl: PrefillSlice, scale: float) -> torch.Tensor:
    """`prefill_flash` with the score and P·V blocks on AMX tiles (bf16 in, float32 sums; the
    softmax stays AVX-512). Head sizes not a multiple of 64 run the AVX512-BF16 kernel."""
    assert sl.block_table is not None, "flash prefill needs the sequence's block table"
    return torch.ops.yuebing.flash_prefill_attention_amx(q, k_cache, v_cache, sl.block_table,
                                                         sl.context_len, scale)


def amx_available() -> bool:
    """Whether the native kernels were built with AMX-BF16 and AVX512DQ and this process may use
    the tiles."""
    return native.available() and bool(torch.ops.yuebing.amx_available())


def _flash_amx_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return _flash_supported(dtype, device) and amx_available()


register_prefill("flash_amx", prefill_flash_amx, _flash_amx_supported)
NATIVE_ATTENTION = frozenset({"paged", "flash", "flash_amx"})
"""Attention paths that need the native kernels (the engine drops them with kernels=torch)."""


def resolve_kernels(name: str, device: torch.device, dtype: torch.dtype) -> KernelOps:
    """The `KernelOps` for ``EngineConfig.kernels`` on this device/dtype (builds if needed)."""
    if name not in KERNELS:
        raise ConfigError(f"kernels {name!r} unknown; use one of {KERNELS}")
    if name == "torch":
        return TorchOps()
    unusable = ""
    if device.type != "cpu":
        unusable = f"native kernels run on CPU only, not {device.type}"
    elif dtype not in NATIVE_DTYPES:
        unusable = f"native kernels support {NATIVE_DTYPES}, not {dtype}"
    else:
        result = native.load()
        unusable = "" if result.ok else result.error
    if not unusable:
        return NativeOps()
    if name == "native":
        raise ConfigError(f"kernels=native: {unusable}; use kernels=auto or torch")
    if device.type == "cpu":
        log.warning("native kernels unavailable (%s); using the torch ops", unusable)
    return TorchOps()
