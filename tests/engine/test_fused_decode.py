"""Fused small-batch decode (`yuebing.engine.fused_decode`): the fused layer against the op-by-op
one on a random bf16 model (logits close, K/V written alike; across partitions, GQA 4), input
checks of the native ops, an adopted request's joined step, the engine's choice and its report,
and batch-invariant mode never using it. Token parity on the real model is in
test_real_model.py."""

from __future__ import annotations

import pytest
import torch
from engine_factories import TINY, make_engine, prompts, tiny

from yuebing.core.errors import ConfigError
from yuebing.engine import amx_linear, fused_decode
from yuebing.engine.config import EngineConfig
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.weights import dummy_weights, parse_dummy_spec

pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.fixture(autouse=True)
def _needs_bf16_dot() -> None:
    if not fused_decode.available():
        pytest.skip("native kernels built without AVX512-BF16: the fused decode does not run")


def _engine(**kw: object):
    return make_engine(tiny(), dtype="bfloat16", kernels="native", attention="auto", **kw)


def _decode_logits(engine, fused, batch: list[list[int]], steps: int = 4):
    engine.model.fused = fused
    captured: list[torch.Tensor] = []
    engine.logits_hook = lambda rids, logits: captured.append(logits.clone())
    outs = engine.generate(batch, SamplingParams(max_tokens=steps, temperature=0,
                                                 ignore_eos=True))
    engine.logits_hook = None
    return [o.output_token_ids for o in outs], captured


def _assert_fused_matches_ops(engine, batch: list[list[int]], steps: int) -> None:
    """The fused layer's decode logits against op by op's, step by step, within bf16 noise."""
    _, fused = _decode_logits(engine, engine.model.fused, batch, steps=steps)
    _, ops = _decode_logits(engine, None, batch, steps=steps)
    assert len(fused) == len(ops)
    for a, b in zip(fused, ops, strict=True):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 0.05 * scale + 0.05


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_fused_step_matches_op_by_op(rows: int) -> None:
    """Where the CPU grants AMX tiles the weights are packed for them (up to 16 rows), else
    row-major for dot products (up to 8)."""
    tiles = fused_decode.tiles_available()
    if rows > 8 and not tiles:
        pytest.skip("more than 8 rows run fused on AMX tiles only")
    engine = _engine(fused_decode=max(rows, 8), prefix_caching=False, max_batch_tokens=512,
                     num_blocks=256)
    fused = engine.model.fused
    assert fused is not None and engine.decode_fused == f"b<={max(rows, 8)}"
    assert fused.tiles == tiles and fused.limit == (16 if tiles else 8)
    assert (fused.layers[0][1].dim() == 5) == tiles  # qkv packed as amx_linear.pack does
    batches: list[int] = []
    real = fused.layer
    fused.layer = lambda i, x, *a: batches.append(x.shape[0]) or real(i, x, *a)  # type: ignore
    # the same steps (no prefix hits), each row close (prefill logits too: the fused head)
    _assert_fused_matches_ops(engine, prompts(rows, seed=rows), steps=4)
    assert max(batches) == rows  # every row decoded in one fused step


def _unpack(packed: torch.Tensor, silu_pairs: bool = False) -> torch.Tensor:
    """The row-major ``[out, in]`` weight of `amx_linear.pack` (or `pack_silu_pairs`)."""
    blocks, tiles = packed.shape[0], packed.shape[1]
    w = packed.permute(0, 3, 1, 2, 4).reshape(blocks * 16, tiles * 32)
    if silu_pairs:  # gate block 0, up block 0, ... back to all gates, then all ups
        w = w.reshape(blocks // 2, 2, 16, tiles * 32).transpose(0, 1).reshape(w.shape)
    assert torch.equal((amx_linear.pack_silu_pairs if silu_pairs else amx_linear.pack)(w),
                       packed)
    return w.contiguous()


def test_row_major_fused_step_matches_op_by_op_beside_tiles() -> None:
    """The dot-product layer (the path of CPUs without AMX) where the tiles are taken too."""
    engine = _engine(fused_decode=8, prefix_caching=False)
    fused = engine.model.fused
    assert fused is not None and fused.head is not None
    if fused.tiles:
        layers = [(ln1, _unpack(qkv), _unpack(o), ln2, _unpack(gu, True), _unpack(down))
                  for ln1, qkv, o, ln2, gu, down in fused.layers]
        engine.model.fused = fused_decode.FusedDecode(
            fused.cfg, layers, fused.rope, (fused.head[0], _unpack(fused.head[1])),
            tiles=False, max_rows=8)
    assert not engine.model.fused.tiles and engine.model.fused.limit == 8
    _assert_fused_matches_ops(engine, prompts(5, seed=4), steps=3)


@pytest.mark.parametrize(("hidden", "threads"), [(64, 1), (256, 1), (256, 2)])
def test_fused_step_over_several_partitions_matches_op_by_op(hidden: int, threads: int) -> None:
    """Contexts past the 512-token partitions of the paged attention: the fused layer runs a task
    per (row, partition, kv head) and merges the partials like the paged op (head_dim 16: the
    portable loops; 64: the AVX-512 ones)."""
    spec = TINY.replace("hidden=64", f"hidden={hidden}").replace("ctx=512", "ctx=2048")
    weights = dummy_weights(parse_dummy_spec(spec), seed=3)
    engine = make_engine(weights, model=spec, dtype="bfloat16", kernels="native",
                         attention="auto", fused_decode=8, prefix_caching=False,
                         num_blocks=1024, max_batch_tokens=512, threads=threads)
    assert engine.model.fused is not None
    gen = torch.Generator().manual_seed(11)
    batch = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1100, 600, 30)]
    _assert_fused_matches_ops(engine, batch, steps=3)


@pytest.mark.parametrize("hidden", [64, 256])
def test_fused_step_across_a_partition_boundary_with_gqa_4_matches_op_by_op(hidden: int) -> None:
    """Contexts that cross the 512-token partitions during the decode (a prompt of 510: 511,
    512, then 513 tokens; of 1022: 1023 to 1025), with four query heads on one KV head."""
    spec = (TINY.replace("hidden=64", f"hidden={hidden}").replace("kv_heads=2", "kv_heads=1")
            .replace("ctx=512", "ctx=2048"))
    weights = dummy_weights(parse_dummy_spec(spec), seed=5)
    engine = make_engine(weights, model=spec, dtype="bfloat16", kernels="native",
                         attention="auto", fused_decode=8, prefix_caching=False,
                         num_blocks=512, max_batch_tokens=512)
    assert engine.model.fused is not None
    gen = torch.Generator().manual_seed(13)
    batch = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (510, 1022)]
    _assert_fused_matches_ops(engine, batch, steps=4)


def test_an_adopted_request_joins_a_fused_decode_step() -> None:
    """A decode instance's new request (KV imported, one token left) joins the running decodes
    as one more row: its first step is decode-only, so the fused layer runs it."""
    from yuebing.engine.kv_transfer import adopt_request, reserve_blocks

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    pre, dec = (_engine(fused_decode=8, prefix_caching=False) for _ in range(2))
    fused = dec.model.fused
    assert fused is not None
    p, q = prompts(2, seed=8, lo=21, hi=30)
    qid = dec.add_request(q, greedy)
    while not dec.get_sequence(qid).output_ids:
        dec.step()
    rid = pre.add_request(p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                          hold_kv=True)
    first = pre.step()[0].new_token_ids[0]
    held = pre.held_sequence(rid)
    assert held is not None
    blocks = reserve_blocks(dec, len(p))
    for layer in range(dec.pool.num_layers):
        dec.pool.import_layer(layer, blocks, pre.pool.export_layer(layer, held.blocks))
    adopt_request(dec, "r", p, blocks, first, greedy)
    layers: list[int] = []
    real = fused.layer
    fused.layer = lambda i, *a: layers.append(i) or real(i, *a)  # type: ignore[method-assign]
    dec.step()
    plan = dec.last_plan
    assert plan is not None and not plan.prefills and len(plan.decodes) == 2
    assert [s.request_id for s in plan.joined] == ["r"]
    assert layers == list(range(dec.pool.num_layers))  # every layer of that step fused


@pytest.mark.parametrize("over", [False, True])
def test_prefill_logits_take_the_fused_head_up_to_its_rows(over: bool) -> None:
    """A prefill step's logits rows (one per finishing sequence) run the fused LM head when
    there are at most `FusedDecode.limit` of them (8, 16 on tiles), else oneDNN's; both agree."""
    engine = _engine(fused_decode=1, prefix_caching=False, max_batch_tokens=512, num_blocks=128,
                     max_num_seqs=32)
    cand = engine.model.fused
    assert cand is not None
    seqs = cand.limit + 1 if over else 1
    calls: list[int] = []
    real = cand.logits
    cand.logits = lambda res, x: calls.append(res.shape[0]) or real(res, x)  # type: ignore
    batch = prompts(seqs, seed=7)
    _, fused = _decode_logits(engine, cand, batch, steps=1)
    _, ops = _decode_logits(engine, None, batch, steps=1)
    assert calls == ([] if over else [seqs])
    assert len(fused) == len(ops) == 1 and fused[0].shape[0] == seqs
    scale = float(ops[0].abs().max())
    assert float((fused[0] - ops[0]).abs().max()) <= 0.05 * scale + 0.05


def test_engine_reports_its_choice_and_invariant_mode_never_fuses() -> None:
    engine = _engine()
    sig = engine.signature()
    assert sig["decode_fused"] == engine.decode_fused
    assert engine.decode_fused == "off" or engine.decode_fused.startswith("b<=")
    assert (engine.model.fused is None) == (engine.decode_fused == "off")
    if engine.model.fused is not None:
        assert engine.decode_fused == f"b<={engine.model.fused.max_rows}"
    inv = make_engine(tiny(), dtype="bfloat16", kernels="native", attention="auto",
                      batch_invariant=True)
    assert inv.decode_fused == "off" and inv.model.fused is None
    assert inv.signature()["decode_fused"] == "off"
    torch_ops = make_engine(tiny(), dtype="bfloat16", kernels="torch")
    assert torch_ops.decode_fused == "off" and torch_ops.model.fused is None
    assert _engine(fused_decode=0).decode_fused == "off"


def test_forced_fused_decode_where_it_cannot_run_is_refused() -> None:
    with pytest.raises(ConfigError, match="fused_decode 2 needs the native kernels"):
        make_engine(tiny(), dtype="float32", kernels="native", fused_decode=2)
    with pytest.raises(ConfigError, match="cannot be used with batch_invariant"):
        make_engine(tiny(), dtype="bfloat16", kernels="native", attention="auto",
                    batch_invariant=True, fused_decode=2)
    with pytest.raises(ConfigError, match="fused_decode must be -1"):
        EngineConfig(fused_decode=17)
    if not fused_decode.tiles_available():
        with pytest.raises(ConfigError, match="fused_decode 9 exceeds the fused ops' 8 rows"):
            _engine(fused_decode=9)


def _layer_args(rows: int = 1, hd: int = 16, heads: int = 4, kvh: int = 2, hidden: int = 64,
                ffn: int = 96) -> list[object]:
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(bf)

    return [r(rows, hidden), r(rows, hidden), r(hidden), r((heads + 2 * kvh) * hd, hidden),
            r(hidden, heads * hd), r(hidden), r(2 * ffn, hidden), r(hidden, ffn), r(32, hd // 2),
            r(32, hd // 2), torch.zeros(rows, dtype=torch.long), r(4, kvh, 4, hd),
            r(4, kvh, 4, hd), torch.zeros(rows, dtype=torch.long),
            torch.zeros(rows, 1, dtype=torch.int32), torch.ones(rows, dtype=torch.int32),
            heads, kvh, 1e-5, hd**-0.5, False]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 9, 16])
def test_packed_layer_and_head_match_the_row_major_ones(rows: int, threads: int) -> None:
    """The ops on tiles (weights packed) against the dot products (row-major) on the same
    input: a block of 64 outputs and single 16-output blocks (one thread: 8 QKV blocks, 6 of
    gate/up; two: 4 and 3 each, an odd share of gate/up pairs), up to 16 rows."""
    if not fused_decode.tiles_available():
        pytest.skip("no AMX tiles here: the fused ops take row-major weights only")
    args = _layer_args(rows=rows)
    bf = torch.bfloat16
    args[11] = torch.randn(rows, 2, 4, 16).to(bf)  # a block per row: no shared KV slot
    args[12] = torch.randn(rows, 2, 4, 16).to(bf)
    args[13] = torch.arange(rows, dtype=torch.long) * 4
    args[14] = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    packed = list(args)
    for i in (3, 4, 7):
        packed[i] = amx_linear.pack(args[i])  # type: ignore[arg-type]
    packed[6] = amx_linear.pack_silu_pairs(args[6])  # type: ignore[arg-type]

    def run(a: list[object]) -> tuple[torch.Tensor, ...]:
        a = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
        out = torch.ops.yuebing.decode_layer(*a)
        return out.float(), a[1].float(), a[11].float(), a[12].float()  # type: ignore[union-attr]

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for got, want in zip(run(packed), run(args), strict=True):
            assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max()) + 0.02
        head = torch.randn(256, 64).to(bf)
        res, x, norm = args[1], args[0], torch.ones(64, dtype=bf)
        a = torch.ops.yuebing.decode_logits(res, x, norm, amx_linear.pack(head), 1e-5)
        b = torch.ops.yuebing.decode_logits(res, x, norm, head, 1e-5)
        assert a.shape == b.shape == (rows, 256)
        assert float((a - b).abs().max()) <= 0.02 * float(b.abs().max()) + 0.02
    finally:
        torch.set_num_threads(old)


def test_tiles_share_the_amx_linears_packed_weights() -> None:
    """A projection the AMX linear holds packed is the fused decode's weight too (one copy)."""
    engine = _engine(fused_decode=8)
    fused = engine.model.fused
    if fused is None or not fused.tiles:
        pytest.skip("no AMX tiles here")
    copies = [(qkv.clone(), None, gu.clone(), None) for _, qkv, _, _, gu, _ in fused.layers]
    o_before = [layer[2] for layer in fused.layers]
    fused.share(copies)
    for (_, qkv, o, _, gu, _), (cq, _, cg, _), ob in zip(fused.layers, copies, o_before,
                                                          strict=True):
        assert qkv is cq and gu is cg and o is ob  # None: its own copy stays


def test_native_layer_runs_and_refuses_bad_input() -> None:
    op = torch.ops.yuebing.decode_layer
    out = op(*_layer_args())
    assert out.shape == (1, 64) and out.dtype == torch.bfloat16 and bool(out.isfinite().all())
    too_many = _layer_args(rows=17)
    with pytest.raises(RuntimeError, match="rows <= 16"):
        op(*too_many)
    mixed = _layer_args()
    mixed[3] = amx_linear.pack(mixed[3])  # type: ignore[arg-type]  # qkv packed, the rest not
    with pytest.raises(RuntimeError, match="packed"):
        op(*mixed)
    bad_slot = _layer_args()
    bad_slot[13] = torch.tensor([16])  # the pool has 4 blocks of 4 slots
    with pytest.raises(RuntimeError, match="slot 16 outside the pool of 16 slots"):
        op(*bad_slot)
    bad_block = _layer_args()
    bad_block[14] = torch.tensor([[7]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block 7 outside the pool of 4"):
        op(*bad_block)
    fp32 = _layer_args()
    fp32[3] = fp32[3].float()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="wqkv must be a contiguous bfloat16"):
        op(*fp32)
    with pytest.raises(RuntimeError, match="rows <= 16"):
        torch.ops.yuebing.decode_logits(torch.zeros(17, 64, dtype=torch.bfloat16),
                                        torch.zeros(17, 64, dtype=torch.bfloat16),
                                        torch.ones(64, dtype=torch.bfloat16),
                                        torch.zeros(10, 64, dtype=torch.bfloat16), 1e-5)
