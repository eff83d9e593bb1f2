"""oneDNN-packed matmul weights: same products as F.linear, used by bf16 CPU engines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_factories import make_engine, prompts, tiny

from yuebing.engine.linear import MIN_ROWS_CANDIDATES, Linear, can_pack, invariant_min_rows
from yuebing.engine.sampling import SamplingParams

needs_pack = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="no oneDNN weight packing on this torch build or CPU")


def test_can_pack_only_low_precision_cpu():
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("cuda"))


def test_unpacked_linear_is_f_linear():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    x = torch.randn(5, 16, generator=gen)
    lin = Linear(w, b, pack=False)
    assert not lin.is_packed
    assert torch.equal(lin(x), F.linear(x, w, b))


@needs_pack
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear_for_any_row_count(rows: int, bias: bool):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    lin = Linear(w, b, pack=True, batch_hint=16)
    assert lin.is_packed and lin.weight is None
    ref = (x.float() @ w.float().T + (0 if b is None else b.float()))
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    # both accumulate in float32 and round the result to bf16: within one bf16 ulp
    torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=2**-6)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=2**-7, atol=2**-6)


@needs_pack
def test_bf16_engine_packs_and_matches_unpacked_logits():
    w = tiny()
    packed = make_engine(w, dtype="bfloat16")
    plain = make_engine(w, dtype="bfloat16", packed_weights=False)
    assert packed.model.packed and not plain.model.packed
    seen: dict[str, list[torch.Tensor]] = {"packed": [], "plain": []}
    for name, eng in (("packed", packed), ("plain", plain)):
        eng.logits_hook = lambda ids, logits, name=name: seen[name].append(logits.clone())
        eng.generate(prompts(3, seed=5), SamplingParams(max_tokens=4, temperature=0))
    assert len(seen["packed"]) == len(seen["plain"]) == 4
    for a, b in zip(seen["packed"], seen["plain"], strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probed_padding_gives_each_row_the_same_bits_at_any_row_count(dtype: torch.dtype):
    """SmolLM2's down projection (1,536 -> 576): oneDNN sums a short input (fewer than 8 rows
    on AVX-512 CPUs) in another order than a long one, so a row's bits depend on the batch
    unless short inputs are padded to the probed row count."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(576, 1536, generator=gen) * 0.05).to(dtype)
    lin = Linear(w, pack=can_pack(dtype, torch.device("cpu")))
    rows = invariant_min_rows([lin])
    assert rows is not None and lin.min_rows == 1  # the probe leaves the matmul as it was
    lin.min_rows = rows
    x = torch.randn(300, 1536, generator=gen).to(dtype)
    full = lin(x)
    for m in (1, 2, 3, 7, 13, 64):
        got = torch.cat([lin(x[i:i + m]) for i in range(0, 128, m)])[:128]
        assert torch.equal(got, full[:128]), m
    assert lin(x[:0]).shape == (0, 576)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_probe_multiplies_on_the_weights_device():
    """The probe's inputs live where the weight does (a CUDA engine in batch-invariant mode,
    the default, probes at start-up)."""
    lin = Linear(torch.randn(64, 128, device="cuda", dtype=torch.bfloat16))
    assert invariant_min_rows([lin]) in (*MIN_ROWS_CANDIDATES, None)
