"""oneDNN-packed matmul weights: same products as F.linear, used by bf16 CPU engines; the
measured plain route at prefill row counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_factories import make_engine, prompts, tiny

from yuebing.core import choices as core_choices
from yuebing.engine import engine as engine_module
from yuebing.engine import linear as linear_module
from yuebing.engine.linear import (
    MIN_ROWS_CANDIDATES,
    ROUTE_ROUNDS,
    Linear,
    can_pack,
    choose_routes,
    invariant_min_rows,
    plain_ranges,
    shape_key,
)
from yuebing.engine.sampling import SamplingParams

needs_pack = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="no oneDNN weight packing on this torch build or CPU")


def test_can_pack_cpu_only():
    assert can_pack(torch.float32, torch.device("cpu")) == torch.backends.mkldnn.is_available()
    assert not can_pack(torch.bfloat16, torch.device("cuda"))
    assert not can_pack(torch.float32, torch.device("cuda"))


def test_packed_fp32_linear_matches_f_linear():
    """fp32 weights packed for oneDNN compute the same product as F.linear (to rounding), at
    decode and prefill row counts."""
    if not can_pack(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN packing does not run here")
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    lin = Linear(w, b, pack=True)
    assert lin.is_packed and lin.shape == (96, 64)
    for rows in (1, 8, 300):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


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


def test_plain_ranges_cover_a_factor_sqrt2_around_each_chosen_point():
    points = (128, 256, 512, 1024)
    assert plain_ranges(points, []) == ()
    assert plain_ranges(points, [512]) == ((363, 725),)
    # neighbours merge; rows beyond the points stay packed
    assert plain_ranges(points, [128, 256, 1024]) == ((91, 363), (725, 1449))


@needs_pack
def test_plain_rows_run_torch_mm_and_the_rest_the_packed_weight():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 32, generator=gen).bfloat16()
    x = torch.randn(40, 32, generator=gen).bfloat16()
    lin, ref = Linear(w, pack=True), Linear(w, pack=True)
    lin.use_plain(w, ((10, 20),))
    for rows in (9, 10, 19, 20):
        want = torch.mm(x[:rows], w.t()) if 10 <= rows < 20 else ref(x[:rows])
        assert torch.equal(lin(x[:rows]), want), rows
    with pytest.raises(ValueError, match="not this"):
        lin.use_plain(w.t().contiguous(), ((10, 20),))
    lin.use_plain(None, ((10, 20),))
    assert lin.plain is None and lin.plain_rows == ()


@needs_pack
def test_choose_routes_times_both_routes_per_shape_and_row_count():
    gen = torch.Generator().manual_seed(3)
    ws = [torch.randn(48, 32, generator=gen).bfloat16() for _ in range(2)]
    pairs = [(Linear(w, pack=True), w) for w in ws] + [(Linear(ws[0]), ws[0])]  # one unpacked
    plain, timings = choose_routes(pairs, points=(8, 16), rounds=1)  # 2 weights of one shape
    assert set(timings) == {f"48x32@{m}_{r}" for m in (8, 16)
                            for r in ("packed", "mm", "ratio", "ratio_hi")}
    assert set(plain) <= {"48x32"} and all(set(v) <= {8, 16} for v in plain.values())


@needs_pack
@pytest.mark.parametrize(("wins", "chosen"), [(9, True), (7, True), (6, False), (0, False)])
def test_torch_mm_takes_rows_only_where_it_wins_most_rounds(
        monkeypatch: pytest.MonkeyPatch, wins: int, chosen: bool):
    """9 rounds: mm at 0.5x the packed time in ``wins`` of them, 3x in the rest (a loaded host's
    bursts). Its median ratio is 0.5 from 5 wins on; it takes the rows from 7 (3/4 of 9)."""
    def samples(fns, device, rounds):  # type: ignore[no-untyped-def]
        assert rounds == ROUTE_ROUNDS == 9 and list(fns) == ["packed", "mm"]
        return {"packed": [1.0] * 9, "mm": [0.5] * wins + [3.0] * (9 - wins)}

    monkeypatch.setattr(linear_module, "interleaved_samples", samples)
    w = torch.randn(48, 32).bfloat16()
    plain, timings = choose_routes([(Linear(w, pack=True), w)], points=(16,))
    assert plain == ({"48x32": [16]} if chosen else {})
    assert timings["48x32@16_ratio_hi"] == (0.5 if chosen else 3.0)


@needs_pack
def test_engine_routes_what_the_machine_measured_and_the_next_engine_reads_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(core_choices, "choice_dir", lambda: tmp_path)
    w = tiny()
    calls: list[list[int]] = []

    def measure(pairs: list[tuple[Linear, torch.Tensor]],  # type: ignore[no-untyped-def]
                points: list[int]):
        calls.append(points)
        return {shape_key(pairs[1][0]): [256, 2048]}, {"t": 1.0}  # the O projection's shape

    monkeypatch.setattr(engine_module, "choose_routes", measure)
    monkeypatch.setattr(engine_module, "choose_amx", lambda *a: ({}, {}))  # routes alone here
    for _ in range(2):
        eng = make_engine(w, dtype="bfloat16", max_batch_tokens=2048)
        o = eng.model.layers[0].o
        assert o.plain_rows == ((182, 363), (1449, 2897)) and o.plain is not None
        assert eng.signature()["matmul"] == f"onednn-packed mm:{shape_key(o)}@256,2048"
        assert all(lay.o.plain_rows == o.plain_rows and lay.qkv.plain_rows == ()
                   and lay.gate_up.plain_rows == lay.down.plain_rows == ()
                   for lay in eng.model.layers)
    assert calls == [[256, 512, 1024, 2048]]  # the second engine read the first one's choice
    make_engine(w, dtype="bfloat16", max_batch_tokens=512)  # only the points for such steps
    assert calls[1:] == [[256, 512]]
    small = make_engine(w, dtype="bfloat16")  # 64-row steps: nothing to measure, one route
    assert len(calls) == 2 and small.signature()["matmul"] == "onednn-packed"
    inv = make_engine(w, dtype="bfloat16", batch_invariant=True, attention="auto")  # one route
    assert all(lay.o.plain_rows == () for lay in inv.model.layers)
    assert inv.signature()["matmul"] == "onednn-packed"
