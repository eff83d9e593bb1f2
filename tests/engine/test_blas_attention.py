"""The MKL-GEMM prefill path (``blas``): exact fp32 scores from bf16 inputs, the same result as
the grouped path in bf16 and the fp32 reference within bf16 rounding, over tiles, cached
offsets and GQA ratios; refused where it cannot run."""

from __future__ import annotations

import pytest
import torch

from yuebing.core.errors import ConfigError
from yuebing.engine import blas_attention
from yuebing.engine.attention import (
    PrefillSlice,
    causal_mask,
    head_index,
    prefill_grouped,
    prefill_sdpa,
    prefill_supported,
)
from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine

pytestmark = pytest.mark.skipif(not blas_attention.available(),
                                reason="torch build without MKL's cblas_gemm_bf16bf16f32")
BS, HD = 16, 64


def test_scores_gemm_is_exact_fp32_of_bf16_inputs():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(37, HD, generator=g) * 4).bfloat16()
    b = (torch.randn(300, HD, generator=g) * 4).bfloat16()
    out = torch.empty(37, 300)
    blas_attention.scores_bf16_f32(a, b, out, 0.5)
    ref = (a.double() @ b.double().T * 0.5).float()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    # strided rows (a slice of a wider matrix) are fine; bad dtypes and shapes are refused
    blas_attention.scores_bf16_f32(a[:, :32], b[:, :32], out, 1.0)
    torch.testing.assert_close(out, a[:, :32].float() @ b[:, :32].float().T, rtol=1e-5, atol=1e-4)
    with pytest.raises(TypeError, match="bf16 x bf16 -> fp32"):
        blas_attention.scores_bf16_f32(a.float(), b, out, 1.0)
    with pytest.raises(ValueError, match="bad GEMM operands"):
        blas_attention.scores_bf16_f32(a, b, torch.empty(37, 299), 1.0)


@pytest.mark.parametrize(("heads", "kvh"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize(("n", "ctx", "tile"), [(600, 600, 256), (300, 790, 128), (1, 77, 256),
                                                 (257, 257, 256)])
def test_prefill_blas_matches_grouped_and_reference(heads, kvh, n, ctx, tile):
    g = torch.Generator().manual_seed(n + ctx)
    blocks = 60
    k_cache = torch.randn(blocks, kvh, BS, HD, generator=g).bfloat16()
    v_cache = torch.randn(blocks, kvh, BS, HD, generator=g).bfloat16()
    table = torch.randperm(blocks, generator=g)[: -(-ctx // BS)]
    sl = PrefillSlice(0, n, ctx, head_index(table, kvh), causal_mask(n, ctx, torch.device("cpu")))
    q = (torch.randn(n, heads, HD, generator=g) * 3).bfloat16()
    scale = HD**-0.5
    out = blas_attention.prefill_blas(q, k_cache, v_cache, sl, scale, tile=tile)
    assert out.shape == (n, heads, HD) and out.dtype == torch.bfloat16
    grouped = prefill_grouped(q, k_cache, v_cache, sl, scale)
    torch.testing.assert_close(out.float(), grouped.float(), rtol=0, atol=2e-2)
    ref = prefill_sdpa(q.float(), k_cache.float(), v_cache.float(), sl, scale)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2)


def test_blas_is_bf16_cpu_only_and_config_says_so():
    cpu = torch.device("cpu")
    assert prefill_supported("blas", torch.bfloat16, cpu)
    assert not prefill_supported("blas", torch.float32, cpu)
    assert not prefill_supported("nope", torch.bfloat16, cpu)
    with pytest.raises(ConfigError, match="prefill attention 'blas' does not run with "
                                          "torch.float32"):
        LLMEngine(EngineConfig(model="dummy", dtype="float32", prefill_attention="blas",
                               num_blocks=8, batch_invariant=False))
    with pytest.raises(ConfigError, match="prefill_attention 'nope' unknown"):
        EngineConfig(prefill_attention="nope")
