"""The native flash prefill kernels (``torch.ops.yuebing.flash_prefill_attention``, the ``flash``
prefill path, and its AMX-tile twin ``flash_amx`` where the CPU has AMX-BF16) against the torch
paths: causal chunks with and without a cached prefix, query tiles and key chunks cut at odd
places, GQA ratios 1/3/8, head sizes on the AVX512-BF16/AMX path (64, 128) and the portable path
(32, 80), a strided q; bad inputs refused; NaN propagation."""

from __future__ import annotations

import pytest
import torch

from yuebing.engine.attention import PrefillSlice, causal_mask, head_index, prefill_sdpa
from yuebing.engine.kernels import amx_available, prefill_flash, prefill_flash_amx

BS = 16


pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.fixture(params=["flash", "flash_amx"])
def flash(request, native_kernels):
    """Each flash kernel of this machine (``flash_amx`` is skipped on CPUs without AMX)."""
    if request.param == "flash_amx" and not amx_available():
        pytest.skip("no AMX-BF16 tiles on this CPU / build")
    return prefill_flash if request.param == "flash" else prefill_flash_amx


def _case(n: int, ctx: int, heads: int, kvh: int, hd: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-ctx // BS) + 5
    k_cache = torch.randn(blocks, kvh, BS, hd, generator=g).bfloat16()
    v_cache = torch.randn(blocks, kvh, BS, hd, generator=g).bfloat16()
    table = torch.randperm(blocks, generator=g)[: -(-ctx // BS)]
    sl = PrefillSlice(0, n, ctx, head_index(table, kvh), causal_mask(n, ctx, torch.device("cpu")),
                      table)
    # q as the model produces it: a strided view of the fused projection's output
    qkv = (torch.randn(n, heads + 2 * kvh, hd, generator=g) * 3).bfloat16()
    return qkv[:, :heads], k_cache, v_cache, sl


@pytest.mark.parametrize(("heads", "kvh"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize(("n", "ctx"), [(1, 1), (5, 5), (70, 70), (130, 300), (1, 77),
                                        (257, 257), (33, 1000)])
def test_flash_matches_fp32_reference_like_sdpa(flash, heads, kvh, n, ctx):
    q, k_cache, v_cache, sl = _case(n, ctx, heads, kvh, 64, seed=n * 7 + ctx)
    scale = 64**-0.5
    out = flash(q, k_cache, v_cache, sl, scale)
    assert out.shape == (n, heads, 64) and out.dtype == torch.bfloat16
    ref = prefill_sdpa(q.float(), k_cache.float(), v_cache.float(), sl, scale)
    bf16_sdpa = prefill_sdpa(q, k_cache, v_cache, sl, scale)
    err = (out.float() - ref).abs().max().item()
    # as close to fp32 as torch's own bf16 SDPA (bf16 output and bf16 probabilities)
    assert err <= max(2e-2, 1.5 * (bf16_sdpa.float() - ref).abs().max().item())


@pytest.mark.parametrize("hd", [32, 80, 128])
def test_flash_other_head_sizes(flash, hd):
    q, k_cache, v_cache, sl = _case(100, 180, 6, 2, hd, seed=hd)
    scale = hd**-0.5
    out = flash(q, k_cache, v_cache, sl, scale)
    ref = prefill_sdpa(q.float(), k_cache.float(), v_cache.float(), sl, scale)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)


def test_first_token_attends_only_to_itself(flash):
    q, k_cache, v_cache, sl = _case(3, 3, 4, 4, 64, seed=3)
    out = flash(q, k_cache, v_cache, sl, 0.125)
    first_v = v_cache[sl.block_table[0], :, 0]  # [kvh, hd]: token 0's V of every head
    torch.testing.assert_close(out[0].float(), first_v.float(), rtol=0, atol=0)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda a: {**a, "q": a["q"].float()}, "bfloat16 q / k_cache / v_cache required"),
    (lambda a: {**a, "block_table": a["block_table"].int()}, "contiguous int64 vector"),
    (lambda a: {**a, "context_len": 10_000}, "n <= context_len <= blocks"),
    (lambda a: {**a, "context_len": 2}, "n <= context_len"),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :1]}, "one shape"),
    (lambda a: {**a, "block_table": a["block_table"].clone().index_fill_(0, torch.tensor([1]), 99)},
     r"block_table\[1\] = 99 is outside the pool of 8 blocks"),
    (lambda a: {**a, "block_table": a["block_table"].clone().index_fill_(0, torch.tensor([0]), -3)},
     r"block_table\[0\] = -3 is outside the pool"),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :0], "v_cache": a["v_cache"][:, :0]},
     "empty heads, kv_heads"),
])
@pytest.mark.parametrize("op", ["flash_prefill_attention", "flash_prefill_attention_amx"])
def test_flash_rejects_bad_inputs(op, mutate, message):
    q, k_cache, v_cache, sl = _case(5, 40, 4, 2, 64, seed=9)  # 3 blocks used, 8 in the pool
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": sl.block_table,
            "context_len": 40, "scale": 0.125}
    if op.endswith("_amx") and not amx_available():
        message = "has no AMX-BF16 tiles"  # refused before the operands are looked at
    with pytest.raises(RuntimeError, match=message):
        getattr(torch.ops.yuebing, op)(**mutate(args))


def test_amx_agrees_with_the_avx512_kernel():
    """Same algorithm, same bf16 probabilities: the two kernels differ by bf16 rounding only
    (scores summed in another order), across a 2,048-token causal prefill with GQA."""
    if not amx_available():
        pytest.skip("no AMX-BF16 tiles on this CPU / build")
    q, k_cache, v_cache, sl = _case(600, 2048, 9, 3, 64, seed=5)
    a = prefill_flash_amx(q, k_cache, v_cache, sl, 0.125).float()
    b = prefill_flash(q, k_cache, v_cache, sl, 0.125).float()
    assert (a - b).abs().max().item() <= 2e-2
    assert (a - b).abs().mean().item() <= 1e-3


def test_nan_in_one_key_poisons_exactly_the_rows_that_see_it(flash):
    """Like torch: a NaN score makes the row NaN; rows whose causal window excludes it stay
    finite (a corrupted block must not turn into plausible-looking output)."""
    q, k_cache, v_cache, sl = _case(40, 40, 4, 2, 64, seed=11)
    k_cache = k_cache.clone()
    table = sl.block_table
    k_cache[table[1], 0, 3] = float("nan")  # token 19 (block 1, offset 3), kv head 0
    out = flash(q, k_cache, v_cache, sl, 0.125)
    ref = prefill_sdpa(q.float(), k_cache.float(), v_cache.float(), sl, 0.125)
    assert torch.equal(out.float().isnan().any(-1), ref.isnan().any(-1))
    assert out[19:, :2].isnan().all() and not out[:19].isnan().any() and not out[:, 2:].isnan().any()


@pytest.mark.parametrize("slope", [0.05, 0.5, -0.5])
def test_scores_rising_or_falling_along_the_keys(flash, slope):
    """Scores that climb by more than 8 per 32 keys make the AMX kernel replace its reference
    max (and rescale the output tiles) at every step; falling scores never do. Both must still
    match the float32 reference."""
    q, k_cache, v_cache, sl = _case(300, 700, 6, 2, 64, seed=21)
    k_cache, q = k_cache.clone(), q.clone()
    keys = torch.arange(700, dtype=torch.float32)
    table = sl.block_table
    for i in range(700):  # key i: (i · slope · 8) in dim 0, so a unit q scores i · slope
        k_cache[table[i // BS], :, i % BS, :] *= 0.01
        k_cache[table[i // BS], :, i % BS, 0] = keys[i] * slope * 8
    q[..., 0] = 1.0
    out = flash(q, k_cache, v_cache, sl, 0.125)
    ref = prefill_sdpa(q.float(), k_cache.float(), v_cache.float(), sl, 0.125)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2)
