"""`benchmarks/cpp_sim_vs_live.py`: the simulator's single and group TTFT of one long prompt are
the cost model's prefill and the pipeline formula the live group follows (chunks of the stages'
``--max-batch-tokens``, one chunk of bubble and one hand-off per extra stage); live chunk steps
beside the profile; `benchmarks/cpp_rate.py`'s max rate per TTFT SLO."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "sim"))
from sim_fakes import LinearCost  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cpp_sim_vs_live.py"


def test_sim_ttfts_follow_the_live_pipeline() -> None:
    spec = importlib.util.spec_from_file_location("cpp_sim_vs_live", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    single, group = mod.sim_ttfts(LinearCost(), 8000, 2, 512, 2304)
    assert single == pytest.approx(8.0)  # 1 ms per token
    # 16 chunks of 512: 8 s / 2 · (1 + 1/16), one 512-row hand-off at 1 GB/s
    assert group == pytest.approx(8.0 / 2 * (1 + 1 / 16) + 512 * 2304 / 1e9)
    # the quiet live run: 17.03 s single, 9.13 s group (0.536); the formula gives 0.531
    assert group / single == pytest.approx(9.13 / 17.03, rel=0.02)


def _load(name: str) -> object:
    path = BENCH.parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_live_chunk_steps_are_set_beside_the_profile(tmp_path: Path) -> None:
    """The first 1,000-token prompt's chunks (after a warm-up prompt) against a profile of
    1 ms per new token + 1 µs per new·cached token pair: live/predicted overall, per quarter,
    and the steps' share of the TTFT."""
    from yuebing.conductor.policy.predictors import (
        BivariatePolynomial,
        DecodePredictor,
        Predictors,
        PrefillPredictor,
        TransferPredictor,
    )
    from yuebing.sim.hardware import FittedCostModel

    mod: Any = _load("cpp_sim_vs_live")
    cost = FittedCostModel(Predictors(
        PrefillPredictor(BivariatePolynomial(((1, 0), (1, 1)), (1e-3, 1e-6))),
        DecodePredictor(BivariatePolynomial(((0, 0),), (0.01,))), TransferPredictor()))
    steps = [{"prefill_tokens": 64, "prefill_cached_tokens": 0, "step_s": 0.1},  # warm-up
             {"prefill_tokens": 0, "prefill_cached_tokens": 0, "step_s": 0.01}]  # a decode
    for c in range(0, 1000, 250):
        pred = 250e-3 + 250 * c * 1e-6
        steps.append({"prefill_tokens": 250, "prefill_cached_tokens": c,
                      "step_s": pred * (2 if c >= 500 else 1)})
    trace = tmp_path / "single.steps.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in steps))
    run = mod.first_prompt_steps(trace, 1000)
    assert [s["prefill_cached_tokens"] for s in run] == [0, 250, 500, 750]
    out = mod.steps_vs_profile(cost, run, 1.0, 4.0)
    predicted = sum(250e-3 + 250 * c * 1e-6 for c in (0, 250, 500, 750))
    assert out["predicted_s"] == pytest.approx(predicted, abs=1e-3)
    assert out["live_over_predicted_by_quarter"] == [1.0, 1.0, 2.0, 2.0]
    assert out["steps_over_ttft"] == pytest.approx(sum(s["step_s"] for s in run) / 4.0,
                                                   abs=1e-3)
    with pytest.raises(SystemExit, match="no prompt of 2000 tokens"):
        mod.first_prompt_steps(trace, 2000)


def test_rate_benchmark_takes_each_slo_s_max_rate_before_the_first_miss() -> None:
    """cpp_rate.py: attainment per SLO from one run's TTFTs; the max rate stops at the first
    miss (a lucky pass above it does not count); the ratio says when plain passed nothing."""
    mod: Any = _load("cpp_rate")
    rows = [{"input_tokens": 8000, "status": "ok", "ttft_s": t} for t in (10, 22, 28, 35)] + \
        [{"input_tokens": 100, "status": "ok", "ttft_s": 1.0},
         {"input_tokens": 8000, "status": "error", "ttft_s": None, "error": "boom"}]
    s = mod.summarize(rows, 256, [25.0, 30.0, 40.0])
    assert s["all"]["attainment"] == {"25": 3 / 6, "30": 4 / 6, "40": 5 / 6}
    assert s["short"]["attainment"]["25"] == 1.0 and s["long"]["errors"] == ["boom"]

    def run(rate: float, a20: float, a30: float) -> dict[str, Any]:
        return {"rate": rate, "all": {"attainment": {"20": a20, "30": a30}}}
    cpp = mod.max_rates([run(0.05, 1.0, 1.0), run(0.03, 1.0, 1.0), run(0.07, 0.5, 0.95)],
                        [20.0, 30.0], 0.9)
    plain = mod.max_rates([run(0.03, 0.5, 1.0), run(0.05, 1.0, 0.8), run(0.07, 1.0, 1.0)],
                          [20.0, 30.0], 0.9)
    assert cpp == {"20": 0.05, "30": 0.07} and plain == {"20": None, "30": 0.03}
    assert mod.ratios(cpp, plain) == {"20": "plain: none", "30": pytest.approx(0.07 / 0.03,
                                                                               abs=1e-3)}


def test_a_profile_of_another_engine_than_the_live_one_is_named() -> None:
    """Threads, kernels or chunk that differ between the profile and the live instances make
    sim / live meaningless: each is named; keys outside `SAME` (decode paths) are not compared."""
    mod: Any = _load("cpp_sim_vs_live")
    profile = {"threads": "2", "prefill_attention": "flash_amx", "max_batch_tokens": "512",
               "decode_fused": "b<=2"}
    live = {"threads": "1", "prefill_attention": "sdpa", "max_batch_tokens": "512",
            "decode_fused": "b<=4"}
    assert mod.mismatches(profile, live) == [
        "threads: profile '2' != live '1'",
        "prefill_attention: profile 'flash_amx' != live 'sdpa'"]
    assert mod.mismatches(profile, {}) == []
