"""The native AMX linear: products against F.linear at any row count, the fused SiLU·mul store,
row-count invariance, bad input, the `Linear` routes, the start-up choice and the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_factories import make_engine, prompts, tiny

from yuebing.core import choices as core_choices
from yuebing.engine import amx_linear, native
from yuebing.engine import engine as engine_module
from yuebing.engine import linear as linear_module
from yuebing.engine import model as model_module
from yuebing.engine.kernels import NativeOps
from yuebing.engine.linear import Linear, amx_key, choose_amx
from yuebing.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not (native.load().ok and amx_linear.available()),
                                reason="no AMX-BF16 tiles on this CPU / build")

ROWS = (1, 2, 7, 15, 16, 17, 31, 32, 33, 63, 100, 255, 256, 257, 511, 512, 777, 1024, 2048)
ALL_ROWS = ((1, 1 << 30),)


def _weight(out: int, inner: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inner, generator=gen) * inner**-0.5).bfloat16()


def _rows(m: int, inner: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, inner, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("out", "inner", "bias"), [(960, 576, False), (576, 1536, False),
                                                    (48, 64, True)])  # 48: an odd 16-col block
def test_matches_f_linear_at_any_row_count(rows: int, out: int, inner: int, bias: bool):
    w = _weight(out, inner)
    b = (torch.randn(out) * 0.1).bfloat16() if bias else None
    x = _rows(rows, inner)
    got = amx_linear.linear(x, amx_linear.pack(w), b)
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    # float32 sums of exact products, rounded once: within half a bf16 step (+ sum-order slack)
    assert bool(((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all())
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("rows", (1, 17, 100, 512, 1000))
def test_silu_mul_store_is_silu_and_mul_of_the_plain_product(rows: int):
    w = _weight(2 * 1536, 576)
    b = (torch.randn(2 * 1536) * 0.1).bfloat16()
    x = _rows(rows, 576)
    fused = amx_linear.linear(x, amx_linear.pack_silu_pairs(w), amx_linear.silu_pairs_order(b),
                              amx_linear.SILU_MUL)
    plain = amx_linear.linear(x, amx_linear.pack(w), b)
    assert fused.shape == (rows, 1536)
    assert torch.equal(fused, torch.ops.yuebing.silu_and_mul(plain))  # the same rounding steps
    ref = F.silu(F.linear(x, w, b)[:, :1536].float()) * F.linear(x, w, b)[:, 1536:].float()
    torch.testing.assert_close(fused.float(), ref, rtol=3e-2, atol=3e-2)


def test_each_rows_bits_do_not_depend_on_the_row_count():
    w, x = _weight(576, 576), _rows(300, 576)
    packed = amx_linear.pack(w)
    whole = amx_linear.linear(x, packed)
    for step in (1, 7, 16, 33, 100):
        parts = torch.cat([amx_linear.linear(x[i:i + step], packed) for i in range(0, 300, step)])
        assert torch.equal(parts, whole), step


def test_bad_input_is_refused_with_the_reason():
    w = _weight(64, 64)
    packed = amx_linear.pack(w)
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        amx_linear.linear(_rows(4, 32), packed)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        amx_linear.linear(_rows(4, 64).float(), packed)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        amx_linear.linear(_rows(64, 4).t(), packed)
    with pytest.raises(RuntimeError, match="epilogue 7 unknown"):
        amx_linear.linear(_rows(4, 64), packed, None, 7)
    with pytest.raises(RuntimeError, match="in pairs"):
        amx_linear.linear(_rows(4, 64), amx_linear.pack(_weight(48, 64)), None, 1)
    with pytest.raises(RuntimeError, match="bias must be"):
        amx_linear.linear(_rows(4, 64), packed, torch.zeros(63).bfloat16())
    with pytest.raises(RuntimeError, match="packed must be"):
        amx_linear.linear(_rows(4, 64), w)
    with pytest.raises(ValueError, match="in % 32 == 0"):
        amx_linear.pack(_weight(64, 48))
    assert not amx_linear.fits((64, 48), torch.bfloat16, torch.device("cpu"))
    assert not amx_linear.fits((48, 64), torch.bfloat16, torch.device("cpu"), silu_pairs=True)
    assert not amx_linear.fits((64, 64), torch.float32, torch.device("cpu"))


def test_linear_runs_the_amx_rows_there_and_the_rest_as_before():
    w = _weight(192, 64)
    lin = Linear(w, pack=True)
    lin.use_amx(w, ((8, 16),))
    packed = amx_linear.pack(w)
    for rows in (4, 8, 15, 16, 40):
        x = _rows(rows, 64)
        want = amx_linear.linear(x, packed) if 8 <= rows < 16 else lin._matmul(x)
        assert torch.equal(lin(x), want), rows
    ops = NativeOps()
    gate_up = Linear(w, pack=True)
    gate_up.use_amx(w, ((8, 16),), silu=True)
    x = _rows(9, 64)
    assert torch.equal(gate_up(x), gate_up._matmul(x))  # a SiLU-pair weight: only silu_mul
    assert torch.equal(gate_up.silu_mul(x, ops),
                       amx_linear.linear(x, amx_linear.pack_silu_pairs(w), None, 1))
    assert torch.equal(gate_up.silu_mul(x[:4], ops), ops.silu_mul(gate_up._matmul(x[:4])))
    with pytest.raises(ValueError, match="is not this"):
        lin.use_amx(_weight(64, 64), ALL_ROWS)
    lin.use_amx(None, ())
    assert lin.amx is None and torch.equal(lin(_rows(9, 64)), lin._matmul(_rows(9, 64)))


@pytest.mark.parametrize("wins", [True, False])
def test_choose_amx_takes_a_row_count_only_where_amx_wins_most_rounds(
        monkeypatch: pytest.MonkeyPatch, wins: bool):
    def samples(fns, device, rounds):
        for fn in fns.values():
            fn()  # both candidates run (the AMX one with SiLU fused)
        amx = [0.5] * rounds if wins else [0.5] * (rounds // 2) + [2.0] * (rounds - rounds // 2)
        return {"current": [1.0] * rounds, "amx": amx}

    monkeypatch.setattr(linear_module, "interleaved_samples", samples)
    w, odd = _weight(64, 64), _weight(64, 48)
    lins = [(Linear(w, pack=True), w, True), (Linear(w, pack=True), w, False),
            (Linear(odd, pack=True), odd, False)]  # in % 32 != 0: not timed
    chosen, timings = choose_amx(lins, NativeOps(), points=(16, 32))
    assert chosen == ({"64x64+silu": [16, 32], "64x64": [16, 32]} if wins else {})
    assert "64x48@16_ratio" not in timings and timings["64x64+silu@32_ratio_hi"] > 0


def test_engine_routes_what_the_machine_measured_and_signs_it(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path):
    monkeypatch.setattr(core_choices, "choice_dir", lambda: tmp_path)
    calls: list[list[int]] = []

    def measure(triples, ops, points):
        calls.append(points)
        gate_up = next(lin for lin, _, silu in triples if silu)
        return {amx_key(gate_up, True): [512]}, {"t": 1.0}

    monkeypatch.setattr(engine_module, "choose_amx", measure)
    for _ in range(2):
        eng = make_engine(tiny(), dtype="bfloat16", max_batch_tokens=512, kernels="native")
        lay = eng.model.layers[0]
        assert lay.gate_up.amx_rows == ((363, 725),) and lay.gate_up.amx_silu
        assert lay.qkv.amx is None and lay.o.amx is None and lay.down.amx is None
        assert eng.signature()["matmul"].endswith(f" amx:{amx_key(lay.gate_up, True)}@512")
    assert calls == [[256, 512]]  # the second engine read the first one's choice
    inv = make_engine(tiny(), dtype="bfloat16", batch_invariant=True, attention="auto",
                      max_batch_tokens=512, kernels="native")
    assert all(lay.gate_up.amx is None for lay in inv.model.layers)
    assert "amx" not in inv.signature()["matmul"]
    torch_ops = make_engine(tiny(), dtype="bfloat16", max_batch_tokens=512, kernels="torch")
    assert "amx" not in torch_ops.signature()["matmul"] and len(calls) == 1
    off = make_engine(tiny(), dtype="bfloat16", max_batch_tokens=512, kernels="native",
                      amx_linear=False)
    assert off.amx_routes == "" and all(lay.gate_up.amx is None for lay in off.model.layers)
    assert "amx" not in off.signature()["matmul"]


def test_engine_greedy_tokens_with_every_projection_on_amx(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path):
    """Every row count of every projection on the AMX kernel (gate/up with SiLU fused) gives
    the oneDNN engine's greedy tokens on the tiny model, prompts batched and alone."""
    monkeypatch.setattr(core_choices, "choice_dir", lambda: tmp_path)
    monkeypatch.setattr(engine_module, "choose_amx", lambda triples, ops, points: (
        {amx_key(lin, silu): list(points) for lin, _, silu in triples}, {}))
    monkeypatch.setattr(model_module, "plain_ranges", lambda points, chosen: ALL_ROWS
                        if chosen else ())
    w = tiny()
    amx = make_engine(w, dtype="bfloat16", max_batch_tokens=256, kernels="native",
                      fused_decode=0, threads=2)  # the column blocks split between threads
    assert all(lin.amx_rows == ALL_ROWS for lay in amx.model.layers
               for lin in (lay.qkv, lay.o, lay.gate_up, lay.down))
    monkeypatch.setattr(engine_module, "choose_amx", lambda *a: ({}, {}))
    monkeypatch.setattr(core_choices, "choice_dir", lambda: tmp_path / "ref")  # not the above
    ref = make_engine(w, dtype="bfloat16", max_batch_tokens=256, kernels="native",
                      fused_decode=0, threads=2)
    assert "amx" not in ref.signature()["matmul"]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ps = prompts(6, seed=5, lo=20, hi=120)
    got = [o.output_token_ids for o in amx.generate(ps, greedy)]
    assert got == [o.output_token_ids for o in ref.generate(ps, greedy)]
    assert got[:1] == [o.output_token_ids for o in amx.generate(ps[:1], greedy)]
