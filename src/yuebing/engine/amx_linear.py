"""The native AMX-BF16 linear (``torch.ops.yuebing.amx_linear``, ``csrc/amx_linear.cpp``): weight
packing into AMX B tiles, the call, and where it applies. `linear.Linear` runs its prefill rows
through it where `linear.choose_amx` found it faster than oneDNN on this machine;
``benchmarks/amx_linear_bench.py`` times it per shape.

`pack` lays ``W [out, in]`` out once as ``[out/16, in/32, 16, 16, 2]`` (16 output columns ×
32 inputs per 1 KiB tile, input pairs interleaved as TDPBF16PS reads them); `pack_silu_pairs`
first interleaves the gate and up halves of a fused gate/up weight in blocks of 16 rows, so one
call writes ``silu(gate)·up`` directly (``epilogue`` `SILU_MUL`).
"""

from __future__ import annotations

import torch

from yuebing.engine import native

NONE, SILU_MUL = 0, 1
"""The kernel's ``epilogue``: plain store, or SiLU(gate)·up of a `pack_silu_pairs` weight."""


def available() -> bool:
    """Whether the loaded native kernels run the AMX linear here (AMX-BF16 build, tiles granted;
    never builds)."""
    return native.available() and bool(torch.ops.yuebing.amx_linear_available())


def fits(shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
         silu_pairs: bool = False) -> bool:
    """Whether a ``[out, in]`` weight of this dtype on this device can be packed: bf16 on CPU,
    ``in`` a multiple of 32, ``out`` of 16 (of 32 for a gate/up pair)."""
    out, inner = shape
    return (device.type == "cpu" and dtype == torch.bfloat16 and inner > 0 and inner % 32 == 0
            and out > 0 and out % (32 if silu_pairs else 16) == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (bf16) as the kernel's B tiles ``[out/16, in/32, 16, 16, 2]``."""
    if weight.dim() != 2 or not fits((weight.shape[0], weight.shape[1]), weight.dtype,
                                     weight.device):
        raise ValueError(f"amx_linear.pack: needs a bf16 CPU [out, in] weight with out % 16 == 0 "
                         f"and in % 32 == 0, got {weight.dtype} {tuple(weight.shape)} on "
                         f"{weight.device}")
    out, inner = weight.shape
    return weight.reshape(out // 16, 16, inner // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def silu_pairs_order(t: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) of a fused ``[gate; up]`` tensor reordered as gate block 0 (16 rows),
    up block 0, gate block 1, ...: the column order the SiLU·mul store expects."""
    n = t.shape[0]
    if n % 32:
        raise ValueError(f"amx_linear: a gate/up tensor needs a multiple of 32 rows, got {n}")
    return t.reshape(2, n // 32, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def pack_silu_pairs(weight: torch.Tensor) -> torch.Tensor:
    """`pack` of a fused gate/up weight ``[2·ffn, in]`` (gate first) in `silu_pairs_order`."""
    return pack(silu_pairs_order(weight))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
           epilogue: int = NONE) -> torch.Tensor:
    """``x [rows, in] @ Wᵀ (+ bias)`` from `pack`'s ``packed`` (bf16 out); with `SILU_MUL`,
    ``silu(gate)·up [rows, ffn]`` from `pack_silu_pairs` (bias in `silu_pairs_order`)."""
    out: torch.Tensor = torch.ops.yuebing.amx_linear(x, packed, bias, epilogue)
    return out
