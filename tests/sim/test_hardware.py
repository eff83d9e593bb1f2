"""Cost models: roofline numbers by hand from the paper's Table 1; fitted model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from yuebing.conductor.policy.predictors import (
    BivariatePolynomial,
    DecodePredictor,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
)
from yuebing.core.errors import ConfigError, InputError
from yuebing.sim.hardware import FittedCostModel, ModelSpec, NodeSpec, RooflineCostModel


def test_table1_flops() -> None:
    m = ModelSpec()
    # l·(a·n²·d + b·n·d²) with l=80, a=4, b=22, d=8192, n=8192: 80·26·8192³
    assert m.flops(8192) == 80 * 26 * 8192**3
    assert m.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2


PEAK = 8 * 312e12


def _linear(n: int, mfu: float = 0.466) -> float:
    """Seconds of l·b·n·d² in one pass over n tokens at mfu · n / (n + 256)."""
    return 80 * 22 * n * 8192**2 / (PEAK * mfu * n / (n + 256))


def _attention(n: int, c: int) -> float:
    """Half of Table 1's l·a·d·(n² + 2nc) at attention_mfu 0.601."""
    return 0.5 * 80 * 4 * 8192 * (n * n + 2 * n * c) / (PEAK * 0.601)


def test_roofline_prefill_by_hand() -> None:
    cost = RooflineCostModel()
    one = _linear(8192) + _attention(8192, 0)  # 1.04 s (paper Figure 14: 1.0 s)
    assert cost.prefill_time(8192, 0) == pytest.approx(0.116 + one + 0.01, rel=1e-12)
    assert cost.prefill_time(8192, 0) == pytest.approx(1.04, abs=0.01)
    # incremental over 8192 cached tokens: 2 full chunks; the prefix is loaded first
    load = 8192 * 327_680 / 128e9
    inc = 2 * _linear(8192) + _attention(16384, 8192)
    assert cost.prefill_time(16384, 8192) == pytest.approx(0.116 + load + inc + 0.02, rel=1e-12)
    assert cost.cache_load_time(8192) == pytest.approx(load, rel=1e-12)
    # a tail chunk of 1000 tokens: its linear layers run at their own, lower efficiency
    tail = _linear(8192) + _linear(1000) + _attention(9192, 0)
    assert cost.prefill_time(9192, 0) == pytest.approx(0.116 + tail + 0.02, rel=1e-12)
    assert cost.prefill_time(0, 5000) == 0.0


def test_efficiency_curve_halves_at_mfu_half_tokens() -> None:
    cost = RooflineCostModel()
    assert cost.efficiency(256) == pytest.approx(0.233, rel=1e-12)
    assert cost.efficiency(512) == pytest.approx(0.466 * 2 / 3, rel=1e-12)
    flat = RooflineCostModel(node=NodeSpec(mfu=0.5, mfu_half_tokens=0))
    assert flat.efficiency(1) == flat.efficiency(100_000) == 0.5
    # a pass of 7 tokens whose linear FLOPs take 1 s at MFU 0.5 (no attention: flops_a = 0)
    noattn = RooflineCostModel(ModelSpec(flops_a=0.0), NodeSpec(mfu=0.5, mfu_half_tokens=0))
    n = PEAK * 0.5 / (80 * 22 * 8192**2)
    assert noattn.pass_compute_time([(n, 0)], 7) == pytest.approx(1.0, rel=1e-12)


def test_roofline_prefill_loads_a_huge_prefix_before_computing() -> None:
    cost = RooflineCostModel()
    load = 1_000_000 * 327_680 / 128e9  # 2.56 s to bring the prefix to HBM
    compute = _linear(1) + _attention(1, 1_000_000)
    assert cost.prefill_time(1, 1_000_000) == pytest.approx(0.116 + load + compute + 0.01,
                                                            rel=1e-12)


def test_roofline_decode_and_capacity_by_hand() -> None:
    cost = RooflineCostModel()
    weights = 140e9 / (8 * 2.039e12 * 0.445)
    assert cost.decode_step_time(1, 0) == pytest.approx(weights + 0.0069 + 0.0004, rel=1e-12)
    # one request alone: 27-31 ms per token between 8k and 128k of context (Figure 14)
    assert 0.026 < cost.decode_step_time(1, 8192) < cost.decode_step_time(1, 131072) < 0.033
    kv = (140e9 + 100_000 * 327_680) / (8 * 2.039e12 * 0.445)
    assert cost.decode_step_time(10, 100_000) == pytest.approx(kv + 0.0069 + 0.004, rel=1e-12)
    assert cost.decode_step_time(0, 0) == 0.0
    assert cost.decode_kv_capacity_tokens == int((8 * 80e9 * 0.9 - 140e9) // 327_680)
    assert cost.transfer_time(1e9) == pytest.approx(50e-6 + 1e9 / 100e9)
    assert cost.transfer_time(0) == 0.0


def test_bad_specs_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="mfu"):
        NodeSpec(mfu=1.5)
    with pytest.raises(ConfigError, match="attention_mfu must be in"):
        NodeSpec(attention_mfu=0.0)
    with pytest.raises(ConfigError, match="prefill_overhead_s must be >= 0"):
        NodeSpec(prefill_overhead_s=-0.1)
    with pytest.raises(ConfigError, match="mfu_half_tokens must be >= 0"):
        NodeSpec(mfu_half_tokens=-1)
    with pytest.raises(ConfigError, match="weights do not fit"):
        RooflineCostModel(node=NodeSpec(gpus=1))


def _samples(tmp_path: Path) -> Path:
    prefill = [{"new_tokens": n, "cached_tokens": c,
                "seconds": 0.01 + 1e-4 * n + 1e-9 * n * c + 2e-9 * n * n}
               for n in (128, 512, 2048, 8192) for c in (0, 1024, 4096)]
    decode = [{"batch": b, "context_tokens": x, "seconds": 0.02 + 1e-4 * b + 1e-8 * x}
              for b in (1, 8, 32) for x in (1000, 50_000, 200_000)]
    path = tmp_path / "samples.json"
    path.write_text(json.dumps({"format": "yuebing-profile-samples", "version": 1,
                                "model": "m", "device": "cpu", "prefill": prefill,
                                "decode": decode}))
    return path


def test_fitted_model_from_samples_recovers_exact_coefficients(tmp_path: Path) -> None:
    cost = FittedCostModel.from_file(_samples(tmp_path))
    assert cost.prefill_time(1000, 2000) == pytest.approx(
        0.01 + 0.1 + 1e-9 * 2e6 + 2e-9 * 1e6, rel=1e-6)
    assert cost.decode_step_time(16, 100_000) == pytest.approx(0.02 + 16e-4 + 1e-3, rel=1e-6)
    assert cost.prefill_time(0, 10) == 0.0 and cost.decode_step_time(0, 10) == 0.0
    # not in a profile: Table 1 defaults
    assert cost.kv_bytes_per_token == 327_680
    assert cost.decode_kv_capacity_tokens == RooflineCostModel().decode_kv_capacity_tokens


def test_fitted_model_reads_the_predictor_file(tmp_path: Path) -> None:
    pred = Predictors(
        PrefillPredictor(BivariatePolynomial(((1, 0),), (2e-3,))),
        DecodePredictor(BivariatePolynomial(((0, 0), (1, 0)), (0.03, 1e-3))),
        TransferPredictor(overhead_s=0.001), source="test")
    path = tmp_path / "predictors.json"
    path.write_text(pred.to_json())
    cost = FittedCostModel.from_file(path)
    assert cost.prefill_time(500, 9999) == pytest.approx(1.0)
    assert cost.decode_step_time(10, 12345) == pytest.approx(0.04)
    assert cost.transfer_time(1e9) == pytest.approx(0.001 + 50e-6 + 0.01)


def test_fitted_model_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(InputError, match="neither"):
        FittedCostModel.from_file(bad)
    bad.write_text(json.dumps({"format": "yuebing-profile-samples", "version": 1}))
    with pytest.raises(InputError, match="invalid profile"):
        FittedCostModel.from_file(bad)
    bad.write_text("[1, 2")
    with pytest.raises(InputError, match="not a JSON object"):
        FittedCostModel.from_file(bad)
    with pytest.raises(InputError, match="cannot read"):
        FittedCostModel.from_file(tmp_path / "missing.json")


def test_a_fitted_cost_model_chunks_as_the_profiled_engine() -> None:
    """A pipeline stage's chunk is its engine's ``max_batch_tokens`` (the live CPP unit);
    without it in the profile the default chunk stays."""
    from yuebing.conductor.policy.predictors import (
        DecodePredictor,
        Predictors,
        PrefillPredictor,
        TransferPredictor,
    )
    from yuebing.sim.hardware import FittedCostModel
    pred = Predictors(PrefillPredictor.from_function(lambda n, c: 1e-3 * n),
                      DecodePredictor.from_function(lambda b, t: 0.05), TransferPredictor(),
                      configuration={"max_batch_tokens": "512"})
    assert FittedCostModel(pred).prefill_chunk_tokens == 512
    assert FittedCostModel(replace(pred, configuration={})).prefill_chunk_tokens == 8192
