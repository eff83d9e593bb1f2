"""The two attention paths agree (float32) on shapes the model tests do not reach: several
query tiles, cached offsets, ragged decode lengths; and KV writes land in the right slots."""

from __future__ import annotations

import torch

from yuebing.engine.attention import (
    AttnMetadata,
    PrefillSlice,
    causal_mask,
    decode_grouped,
    decode_sdpa,
    head_index,
    prefill_grouped,
    prefill_sdpa,
    slot_index,
    write_kv,
)

KVH, BS, HD, HEADS = 3, 16, 8, 9


def _pool(blocks: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(blocks, KVH, BS, HD, generator=g),
            torch.randn(blocks, KVH, BS, HD, generator=g))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Plain causal attention: q [n, heads, hd], k/v [ctx, kvh, hd]."""
    k = k.repeat_interleave(HEADS // KVH, dim=1)
    v = v.repeat_interleave(HEADS // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HD**-0.5
    n, ctx = q.shape[0], k.shape[0]
    allowed = torch.arange(ctx)[None, :] <= torch.arange(n)[:, None] + offset
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def _context(k_cache: torch.Tensor, blocks: list[int], ctx: int) -> torch.Tensor:
    return k_cache[blocks].permute(0, 2, 1, 3).reshape(-1, KVH, HD)[:ctx]


def test_prefill_paths_match_reference_over_tiles_and_offsets():
    k_cache, v_cache = _pool(80)
    blocks = torch.randperm(80, generator=torch.Generator().manual_seed(1))[:50].tolist()
    for n, ctx in ((600, 600), (300, 790), (1, 77)):
        q = torch.randn(n, HEADS, HD)
        table = torch.tensor(blocks[: -(-ctx // BS)])
        sl = PrefillSlice(0, n, ctx, head_index(table, KVH), causal_mask(n, ctx, q.device))
        ref = _reference(q, _context(k_cache, table.tolist(), ctx),
                         _context(v_cache, table.tolist(), ctx), ctx - n)
        for impl in (prefill_grouped, prefill_sdpa):
            torch.testing.assert_close(impl(q, k_cache, v_cache, sl, HD**-0.5), ref,
                                       rtol=1e-5, atol=1e-5)


def test_decode_paths_match_reference_with_ragged_lengths():
    k_cache, v_cache = _pool(40, seed=2)
    lens = [5, 33, 16]
    tables = [[3, 0, 0], [7, 8, 9], [1, 0, 0]]
    max_len = 3 * BS
    bias = torch.where(torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None], 0.0,
                       float("-inf"))[:, None, :]
    meta = AttnMetadata(torch.zeros(0, dtype=torch.long), 3,
                        head_index(torch.tensor(tables), KVH), max_len, bias, [])
    q = torch.randn(3, HEADS, HD)
    for impl in (decode_grouped, decode_sdpa):
        out = impl(q, k_cache, v_cache, meta, HD**-0.5)
        for r, (n, table) in enumerate(zip(lens, tables, strict=True)):
            ref = _reference(q[r:r + 1], _context(k_cache, table, n), _context(v_cache, table, n),
                             n - 1)
            torch.testing.assert_close(out[r:r + 1], ref, rtol=1e-5, atol=1e-5)


def test_write_kv_fills_exact_slots():
    k_cache, v_cache = torch.zeros(4, KVH, BS, HD), torch.zeros(4, KVH, BS, HD)
    blocks, offsets = torch.tensor([2, 2, 0]), torch.tensor([0, 15, 7])
    k = torch.arange(3 * KVH * HD, dtype=torch.float32).view(3, KVH, HD)
    meta = AttnMetadata(slot_index(blocks, offsets, KVH, BS), 0, None, 0, None, [])
    write_kv(k_cache, v_cache, k, -k, meta)
    for t in range(3):
        assert torch.equal(k_cache[blocks[t], :, offsets[t]], k[t])
        assert torch.equal(v_cache[blocks[t], :, offsets[t]], -k[t])
    assert int((k_cache != 0).sum()) == 3 * KVH * HD - 1  # token 0 head 0 dim 0 is zero
