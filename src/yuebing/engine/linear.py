"""Matmul weights of the model, optionally pre-packed for oneDNN on CPU.

`LlamaModel` wraps each projection (fused QKV, output, fused gate/up, down, lm_head) in a
`Linear` when it is built, and calls it once per layer and step. On CPU in bfloat16/float16,
``F.linear`` hands a plain row-major weight to oneDNN, which re-lays it out into its blocked
format on every call (a full extra pass over the weight); at decode batch sizes that pass is as
costly as the matmul itself. `pack_weight` does that re-layout once at load time
(``torch.ops.mkldnn._reorder_linear_weight``) and `Linear.__call__` then runs
``torch.ops.mkldnn._linear_pointwise`` on the packed weight. float32, CUDA, builds without
oneDNN, or a packing call that fails keep the plain ``F.linear`` path (same math);
``EngineConfig.packed_weights`` switches packing off, and ``benchmarks/engine_hotpath.py``
measures both paths side by side.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_PACKABLE = (torch.bfloat16, torch.float16)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN weight packing applies to this dtype and device — and works on this CPU
    (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT; tried once per dtype)."""
    return (device.type == "cpu" and dtype in _PACKABLE and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and _packs_here(dtype))


@functools.cache
def _packs_here(dtype: torch.dtype) -> bool:
    try:
        w = torch.zeros(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=dtype), packed, None,
                                           "none", [], "")
    except (RuntimeError, NotImplementedError) as exc:
        log.info("oneDNN weight packing does not run here (%s); bf16/fp16 use F.linear", exc)
        return False
    return True


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """The oneDNN-blocked copy of ``weight [out, in]``, or None where packing fails.

    ``batch_hint`` is the row count the layout is tuned for; any row count still computes the
    same product.
    """
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return None
    return packed


class Linear:
    """``y = x @ weight.T + bias``: plain ``F.linear`` or a oneDNN-packed weight."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool = False, batch_hint: int = 16) -> None:
        self.bias = bias
        self.packed = pack_weight(weight, batch_hint) if pack else None
        # the plain weight is only kept where it is used (the packed copy replaces it)
        self.weight = weight if self.packed is None else None

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
