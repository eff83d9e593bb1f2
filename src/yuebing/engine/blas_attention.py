"""Causal prefill attention on MKL's bf16 × bf16 → fp32 GEMM (``prefill_blas``), called through
`PREFILL_IMPLS` by `LlamaModel._attention` when `choose_attention` measured it fastest.

Torch's CPU SDPA runs bf16 causal attention at ~35–60 GFLOP/s on 2 AVX-512 cores; a bf16
``bmm`` is ~400 GFLOP/s but rounds the scores to bf16, which corrupts a small model's answers.
MKL's ``cblas_gemm_bf16bf16f32`` takes bf16 inputs with exact fp32 products and output: per
query tile, scores through it (one call per KV head), fp32 softmax, then ``P @ V`` as a bf16
``bmm``. Where the symbol is missing (`available`) the path is not registered.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from yuebing.engine import runtime
from yuebing.engine.attention import PrefillSlice, gather_blocks, register_prefill

log = logging.getLogger(__name__)

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enum values


def _load_gemm() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = runtime.libtorch_cpu().cblas_gemm_bf16bf16f32
    except (OSError, AttributeError) as exc:
        log.debug("cblas_gemm_bf16bf16f32 unavailable (%s)", exc)
        return None
    c_int, c_ptr, c_float = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    fn.restype = None
    fn.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, c_float, c_ptr, c_int, c_ptr,
                   c_int, c_float, c_ptr, c_int]
    return fn


_GEMM = _load_gemm()


def available() -> bool:
    """Whether MKL's bf16 GEMM with fp32 output can be called in this process."""
    return _GEMM is not None


def scores_bf16_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: float) -> None:
    """``out [m, n] = alpha * a [m, k] @ b [n, k]^T`` for bf16 ``a``/``b`` (rows contiguous),
    fp32 ``out`` (rows contiguous): exact fp32 dot products of the bf16 inputs."""
    assert _GEMM is not None, "cblas_gemm_bf16bf16f32 is not available"
    m, k = a.shape
    n = b.shape[0]
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or out.dtype != torch.float32:
        raise TypeError(f"expected bf16 x bf16 -> fp32, got {a.dtype} x {b.dtype} -> {out.dtype}")
    if a.stride(1) != 1 or b.stride(1) != 1 or out.stride(1) != 1 or b.shape[1] != k \
            or tuple(out.shape) != (m, n):
        raise ValueError(f"bad GEMM operands {tuple(a.shape)} x {tuple(b.shape)}^T -> "
                         f"{tuple(out.shape)} (rows must be contiguous)")
    _GEMM(_ROW_MAJOR, _NO_TRANS, _TRANS, m, n, k, alpha, a.data_ptr(), a.stride(0),
          b.data_ptr(), b.stride(0), 0.0, out.data_ptr(), out.stride(0))


def prefill_blas(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sl: PrefillSlice, scale: float, tile: int = 256) -> torch.Tensor:
    """``q [n, heads, hd]`` of one sequence's chunk → ``[n, heads, hd]``, causal over the
    cached prefix plus the chunk (same result as `prefill_sdpa` with fp32 scores)."""
    n, heads, hd = q.shape
    kvh = k_cache.shape[1]
    g = heads // kvh
    offset = sl.context_len - n
    k = gather_blocks(k_cache, sl.head_index).view(kvh, -1, hd)
    v = gather_blocks(v_cache, sl.head_index).view(kvh, -1, hd)
    # rows of one KV head's query group, token-major: [kvh, n·g, hd]
    qg = q.view(n, kvh, g, hd).permute(1, 0, 2, 3).reshape(kvh, n * g, hd)
    out = torch.empty(kvh, n * g, hd, dtype=q.dtype, device=q.device)
    hide_full = torch.ones(tile, tile, dtype=torch.bool, device=q.device).triu_(1)
    for s0 in range(0, n, tile):
        s1 = min(n, s0 + tile)
        rows, end = s1 - s0, offset + s1  # keys [0, end) are visible to some row of the tile
        scores = torch.empty(kvh, rows * g, end, dtype=torch.float32, device=q.device)
        for h in range(kvh):
            scores_bf16_f32(qg[h, s0 * g:s1 * g], k[h, :end], scores[h], scale)
        diag = scores.view(kvh, rows, g, end)[..., end - rows:]
        diag.masked_fill_(hide_full[:rows, None, :rows], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        torch.bmm(probs, v[:, :end], out=out[:, s0 * g:s1 * g])
    return out.view(kvh, n, g, hd).permute(1, 0, 2, 3).reshape(n, heads, hd)


def _supports(dtype: torch.dtype, device: torch.device) -> bool:
    return available() and dtype == torch.bfloat16 and device.type == "cpu"


register_prefill("blas", prefill_blas, _supports)
