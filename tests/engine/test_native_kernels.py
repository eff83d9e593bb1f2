"""Native CPU kernels (``torch.ops.yuebing.*``) against the torch reference: paged decode
attention over ragged contexts, block boundaries, GQA ratios 1/3/8, batch 1 and 33 and several
context partitions; the fused per-layer ops in float32/bfloat16/float16; input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from yuebing.engine.attention import AttnMetadata
from yuebing.engine.kernels import NativeOps, TorchOps, decode_paged

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


pytestmark = pytest.mark.usefixtures("native_kernels")


def _pool(blocks: int, kvh: int, bs: int, hd: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(blocks, kvh, bs, hd, generator=gen).to(dtype)
    return k, torch.randn(blocks, kvh, bs, hd, generator=gen).to(dtype)


def _tables(lens: list[int], bs: int, blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Each sequence gets distinct random blocks (a scattered, non-contiguous table)."""
    width = max(-(-n // bs) for n in lens)
    perm = torch.randperm(blocks, generator=gen)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        table[i, :nb] = perm[used:used + nb]
        used += nb
    return table


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
               lens: list[int], scale: float) -> torch.Tensor:
    """Attention in float64 over each sequence's context, gathered token by token."""
    d, heads, hd = q.shape
    kvh, bs = kc.shape[1], kc.shape[2]
    out = torch.empty(d, heads, hd, dtype=torch.float64)
    for i, n in enumerate(lens):
        blocks = [int(table[i, t // bs]) for t in range(n)]
        offs = [t % bs for t in range(n)]
        k = kc[blocks, :, offs].double()  # [n, kvh, hd]
        v = vc[blocks, :, offs].double()
        for h in range(heads):
            j = h // (heads // kvh)
            p = torch.softmax((q[i, h].double() @ k[:, j].T) * scale, dim=-1)
            out[i, h] = p @ v[:, j]
    return out


TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2),
       torch.float16: (2e-3, 1e-3)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kvh,hd,bs,lens", [
    (4, 4, 64, 16, [1, 15, 16, 17, 33]),  # GQA 1, block boundaries
    (9, 3, 64, 16, [40] * 33),  # SmolLM2's shape, batch 33
    (8, 1, 24, 4, [7]),  # GQA 8, head_dim not a multiple of 16 (scalar path), batch 1
    (6, 2, 32, 16, [1100, 3, 513, 512]),  # several 512-token partitions, merged
    (16, 2, 128, 16, [19, 70]),  # GQA 8 at head_dim 128: accumulators kept in memory
])
def test_paged_decode_matches_reference(dtype, heads, kvh, hd, bs, lens):
    gen = torch.Generator().manual_seed(len(lens) * 7 + hd)
    blocks = sum(-(-n // bs) for n in lens) + 3
    kc, vc = _pool(blocks, kvh, bs, hd, dtype, gen)
    table = _tables(lens, bs, blocks, gen)
    q = torch.randn(len(lens), heads, hd, generator=gen).to(dtype)
    scale = hd**-0.5
    out = torch.ops.yuebing.paged_decode_attention(
        q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), scale)
    assert out.dtype == dtype and out.shape == q.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), _reference(q, kc, vc, table, lens, scale),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_decode_is_independent_of_the_batch(dtype):
    """A sequence's output is bit-identical alone and inside a ragged batch whose 600-token
    sequence needs two partitions (float32 shows any rounding difference of the merge)."""
    gen = torch.Generator().manual_seed(5)
    lens = [37, 600, 5, 129]
    kc, vc = _pool(80, 3, 16, 64, dtype, gen)
    table = _tables(lens, 16, 80, gen)
    q = torch.randn(4, 9, 64, generator=gen).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    batch = torch.ops.yuebing.paged_decode_attention(q, kc, vc, table, lens_t, 0.125)
    for i in range(4):
        alone = torch.ops.yuebing.paged_decode_attention(
            q[i:i + 1], kc, vc, table[i:i + 1, :-(-lens[i] // 16)].contiguous(),
            lens_t[i:i + 1], 0.125)
        assert torch.equal(alone[0], batch[i])


def test_decode_paged_reads_a_strided_q_and_the_metadata():
    """`decode_paged` (the DECODE_IMPLS entry) on q viewed out of a fused qkv row."""
    gen = torch.Generator().manual_seed(2)
    kc, vc = _pool(8, 2, 4, 16, torch.float32, gen)
    qkv = torch.randn(3, (4 + 2 * 2) * 16, generator=gen)
    q = qkv[:, :64].view(3, 4, 16)  # row stride 128
    lens = [5, 1, 8]
    table = _tables(lens, 4, 8, gen)
    meta = AttnMetadata(torch.zeros(0, dtype=torch.long), 3, None, 0, None, [],
                        decode_table=table, decode_lens=torch.tensor(lens, dtype=torch.int32))
    torch.testing.assert_close(decode_paged(q, kc, vc, meta, 0.25).double(),
                               _reference(q.contiguous(), kc, vc, table, lens, 0.25),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mutate,message", [
    (lambda a: a.update(table=a["table"].long()), "must be int32"),
    (lambda a: a.update(lens=torch.tensor([0, 3], dtype=torch.int32)), "is < 1"),
    (lambda a: a.update(lens=torch.tensor([9, 3], dtype=torch.int32)), "needs more blocks"),
    (lambda a: a["table"].__setitem__((1, 0), 99), "outside the pool of 6 blocks"),
    (lambda a: a.update(q=a["q"].double()), "must share a dtype"),
    (lambda a: a.update(q=a["q"][:, :3]), "not a multiple of kv_heads"),
    (lambda a: a.update(kc=torch.zeros(6, 0, 4, 8), vc=torch.zeros(6, 0, 4, 8)),
     "empty cache or query shape"),
    (lambda a: a.update(kc=torch.zeros(6, 2, 0, 8), vc=torch.zeros(6, 2, 0, 8)),
     "empty cache or query shape"),
])
def test_paged_decode_rejects_bad_inputs(mutate, message):
    args = {"q": torch.randn(2, 4, 8), "kc": torch.zeros(6, 2, 4, 8),
            "vc": torch.zeros(6, 2, 4, 8), "table": torch.tensor([[0, 1], [2, 3]],
                                                                 dtype=torch.int32),
            "lens": torch.tensor([8, 3], dtype=torch.int32)}
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.yuebing.paged_decode_attention(args["q"], args["kc"], args["vc"],
                                                 args["table"], args["lens"], 1.0)


# ------------------------------------------------------------------------ fused layer ops


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:  # at most one rounding step apart
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 33])
def test_rms_norm_and_fused_add(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    ref_ops, ops = TorchOps(), NativeOps()
    _close(ops.rms_norm(x, w, 1e-5), ref_ops.rms_norm(x, w, 1e-5))
    ref_norm, ref_res = ref_ops.add_rms_norm(x, res, w, 1e-5)
    norm, new_res = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.equal(new_res, ref_res)  # the sum is rounded once, exactly like torch's add
    _close(norm, ref_norm)


@pytest.mark.parametrize("views", [lambda b: (b[:4], b[:4]), lambda b: (b[1:], b[:4])],
                         ids=["same tensor", "overlapping rows"])
def test_fused_add_rms_norm_rejects_aliased_inputs(views):
    """Both x and residual are written: aliasing them is refused and changes nothing."""
    buf = torch.randn(5, 64)
    before = buf.clone()
    x, res = views(buf)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        torch.ops.yuebing.fused_add_rms_norm(x, res, torch.ones(64), 1e-6)
    assert torch.equal(buf, before)


def _rope_case(dtype: torch.dtype, tokens: int, heads: int, kvh: int, hd: int, bs: int):
    gen = torch.Generator().manual_seed(tokens + heads)
    qkv = torch.randn(tokens, (heads + 2 * kvh) * hd, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    freqs = torch.arange(64.0)[:, None] * (1.0 / 10000 ** (torch.arange(0, hd, 2) / hd))[None]
    blocks = -(-tokens // bs) + 2
    slot_perm = torch.randperm(blocks * bs, generator=gen)[:tokens]  # distinct slots
    return qkv, positions, freqs.cos().to(dtype), freqs.sin().to(dtype), blocks, slot_perm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,heads,kvh,hd,bs", [(1, 9, 3, 64, 16), (33, 8, 1, 24, 4),
                                                    (5, 4, 4, 8, 16)])
def test_rope_write_kv_equals_torch(dtype, tokens, heads, kvh, hd, bs):
    """Rotated q and the K/V written to the pool are bit-identical to the torch path (the
    kernel rounds each product and sum through the dtype exactly where torch does)."""
    qkv, positions, cos, sin, blocks, slots = _rope_case(dtype, tokens, heads, kvh, hd, bs)
    blk, off = slots // bs, slots % bs
    meta = AttnMetadata(_slot_rows(blk, off, kvh, bs), 0, None, 0, None, [], slots=slots)
    caches = {}
    for ops in (TorchOps(), NativeOps()):
        kc, vc = torch.zeros(blocks, kvh, bs, hd, dtype=dtype), torch.zeros(
            blocks, kvh, bs, hd, dtype=dtype)
        q = ops.rope_write_kv(qkv.clone(), ops.prepare_rope(positions, cos, sin), kc, vc, meta,
                              heads, kvh)
        caches[ops.name] = (q.contiguous(), kc, vc)
    for ref, got in zip(caches["torch"], caches["native"], strict=True):
        assert torch.equal(ref, got)


def _slot_rows(blk: torch.Tensor, off: torch.Tensor, kvh: int, bs: int) -> torch.Tensor:
    from yuebing.engine.attention import slot_index

    return slot_index(blk, off, kvh, bs)


def test_rope_write_kv_rejects_a_slot_outside_the_pool():
    qkv = torch.zeros(2, (2 + 2) * 8)
    kc = torch.zeros(2, 1, 4, 8)
    with pytest.raises(RuntimeError, match="slot 8 outside the pool of 8 slots"):
        torch.ops.yuebing.rope_write_kv(qkv, torch.zeros(2, dtype=torch.long),
                                        torch.ones(4, 4), torch.zeros(4, 4), kc,
                                        torch.zeros_like(kc), torch.tensor([0, 8]), 2, 1)
    assert not kc.any()  # checked before anything is written


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,ffn", [(1, 1536), (33, 40)])
def test_silu_and_mul(dtype, rows, ffn):
    x = (3 * torch.randn(rows, 2 * ffn, generator=torch.Generator().manual_seed(rows))).to(dtype)
    _close(NativeOps().silu_mul(x), F.silu(x[:, :ffn]) * x[:, ffn:])


def test_ops_reject_unsupported_dtype():
    with pytest.raises(RuntimeError, match="dtype Double unsupported"):
        torch.ops.yuebing.silu_and_mul(torch.zeros(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("op,args", [
    ("rms_norm", (torch.zeros(3, 0), torch.zeros(0), 1e-5)),
    ("silu_and_mul", (torch.zeros(3, 0),)),
])
def test_ops_refuse_empty_rows(op, args):
    with pytest.raises(RuntimeError, match="n > 0"):
        getattr(torch.ops.yuebing, op)(*args)


def test_nan_propagates_like_torch():
    """A NaN score makes that head's output NaN (as torch's softmax does); NaN gates stay NaN."""
    kc = torch.randn(6, 1, 4, 16)
    kc[1, 0, 2, 5] = float("nan")  # token 6 of the sequence: inside the first 16-lane exp
    out = torch.ops.yuebing.paged_decode_attention(
        torch.randn(1, 2, 16), kc, torch.randn(6, 1, 4, 16),
        torch.arange(6, dtype=torch.int32)[None], torch.tensor([24], dtype=torch.int32), 0.25)
    assert out.isnan().all()
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    got = torch.ops.yuebing.silu_and_mul(x)
    assert got[1, 3].isnan() and not got[0].isnan().any()
