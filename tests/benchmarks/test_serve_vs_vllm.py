"""The serving head-to-head helpers (nothing is served here): the HF export's RoPE pinning,
serve_vs_vllm_report's summary and access-log breakdown, sim_vs_live's workload and stats."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TRACE = BENCH.parent.parent / "shared" / "traces" / "conversation_trace.jsonl"


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


export = _load("export_smollm2_hf", BENCH / "peers" / "export_smollm2_hf.py")
report = _load("serve_vs_vllm_report", BENCH / "serve_vs_vllm_report.py")
svl = _load("sim_vs_live", BENCH / "sim_vs_live.py")


def test_rope_theta_pinned_at_top_level_and_in_parameters(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama",
                               "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}))
    export.pin_rope_theta(cfg, 100000.0)
    out = json.loads(cfg.read_text())
    assert out["rope_theta"] == 100000.0
    assert out["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}


def test_rope_theta_mismatch_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"rope_theta": 10000.0}))
    with pytest.raises(SystemExit, match="differs from the GGUF"):
        export.pin_rope_theta(cfg, 100000.0)


@pytest.mark.slow  # GGUFReader indexes every tensor of the file (~10 s quiet, 70 s loaded)
def test_bundled_gguf_rope_base_is_smollm2s() -> None:
    pytest.importorskip("gguf")
    from yuebing.engine.weights import bundled_model_path

    assert export.gguf_rope_theta(bundled_model_path()) == 100000.0


def _summary(att: float) -> dict[str, Any]:
    return {"attainment": att, "ttft_s": {"p50": 1.0, "p90": 2.0}, "tbt_s": {"p50": 0.05,
            "p90": 0.08}, "completed": 2, "rejected": 0, "errors": 0, "requests": 2,
            "capacity": {"100": att, "50": att / 2}, "send_lag_s": {"mean": 0.0, "max": 0.01}}


def test_report_max_rate_ratio_and_breakdown(tmp_path: Path) -> None:
    for name, best in (("yuebing_1p1d", 0.4), ("vllm_cpu", 0.2)):
        rep = {"sweep": [{"rate": 0.2, "summary": _summary(1.0)},
                         {"rate": 0.4, "summary": _summary(0.95 if best == 0.4 else 0.5)}],
               "max_rate": best, **({"config": {"slo_tbt": [0.2, 0.1]}}
                                    if name == "vllm_cpu" else {})}
        (tmp_path / f"{name}.json").write_text(json.dumps(rep))
    logs = tmp_path / "logs" / "yuebing_1p1d"
    logs.mkdir(parents=True)
    line = ("2026-11-25 17:52:15,901 INFO yuebing.conductor.access: cmpl-1 status=200 "
            "prefill=prefill-0 decode=decode-0 prompt={p} cached=0 out=128 finish=length "
            "ttft={t}ms tbt=50.0ms queue=1.0ms prefix_load=0.0ms prefill={t}ms transfer=2.0ms "
            "decode_wait=0.5ms conductor=0.7ms e2e=900.0ms")
    bad = line.replace("status=200", "status=429")
    (logs / "conductor.log").write_text("\n".join(
        [line.format(p=100, t=10.0), bad, line.format(p=200, t=30.0),
         line.format(p=300, t=100.0), line.format(p=400, t=300.0)]) + "\n")
    out = report.summarize(tmp_path)
    assert out["ratio_max_rate_vs_vllm"] == 2.0
    s = out["systems"]["yuebing_1p1d"]
    assert s["capacity"] == {"100": 0.95, "50": 0.475} and s["capacity_at_rate"] == 0.4
    assert s["slo_tbt_s"] == 0.1  # the deciding TBT SLO: the first of the run's (SLO_TBT)
    assert out["systems"]["vllm_cpu"]["slo_tbt_s"] == 0.2
    bd = s["breakdown_ms"]
    assert bd["0.2"]["lines"] == 2 and bd["0.2"]["prefill"]["mean"] == 20.0
    assert bd["0.4"]["prompt"]["mean"] == 350.0  # the 429 line is not a served request


def test_report_of_a_downward_sweep_with_runs_cut_short(tmp_path: Path) -> None:
    # --sweep-down --stop-when-decided: 0.4 ran first and was cut after 1 answer, 0.2 passed;
    # vLLM was cut at both rates, so only a bound on the ratio exists.
    cut = {**_summary(0.3), "completed": 1,
           "cut_short": {"answered": 1, "of": 2, "missed": 2, "attainment_at_most": 0.3}}
    (tmp_path / "yuebing_1p1d.json").write_text(json.dumps(
        {"sweep": [{"rate": 0.4, "summary": cut}, {"rate": 0.2, "summary": _summary(1.0)}],
         "max_rate": 0.2}))
    (tmp_path / "vllm_cpu.json").write_text(json.dumps(
        {"sweep": [{"rate": 0.2, "summary": cut}, {"rate": 0.1, "summary": cut}],
         "max_rate": None}))
    logs = tmp_path / "logs" / "yuebing_1p1d"
    logs.mkdir(parents=True)
    line = ("x status=200 prefill=p decode=d prompt={p} cached=0 out=1 finish=length "
            "ttft=1.0ms tbt=1.0ms queue=1.0ms prefix_load=0.0ms prefill=1.0ms transfer=1.0ms "
            "decode_wait=0.0ms conductor=0.1ms e2e=2.0ms")
    (logs / "conductor.log").write_text("\n".join(line.format(p=p) for p in (900, 100, 300)))
    out = report.summarize(tmp_path)
    s = out["systems"]["yuebing_1p1d"]
    assert [r["rate"] for r in s["sweep"]] == [0.2, 0.4] and s["sweep"][1]["cut_short"]
    assert s["breakdown_ms"]["0.4"]["prompt"]["mean"] == 900.0  # the run made first
    assert s["breakdown_ms"]["0.2"]["prompt"]["mean"] == 200.0
    assert out["ratio_max_rate_vs_vllm"] is None and out["ratio_max_rate_vs_vllm_above"] == 2.0
    assert out["systems"]["vllm_cpu"]["capacity_at_rate"] == 0.1  # its lowest rate
    cut_row = s["sweep"][1]
    cut_row["cut_short"] = {"answered": 80, "of": 300, "missed": 31, "attainment_at_most": 0.897}
    assert report.answered_attainment(cut_row) == pytest.approx(49 / 80)  # the plot's ○
    report.plot(tmp_path, out["systems"])
    assert (tmp_path / "attainment_vs_rate.png").stat().st_size > 0


def test_report_puts_vllm_1p1d_beside_coupled_vllm_and_yuebing(tmp_path: Path) -> None:
    for name, best in (("vllm_1p1d", 0.15), ("vllm_cpu", 0.1), ("yuebing_1p1d", 0.3)):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"sweep": [{"rate": best, "summary": _summary(0.95)}], "max_rate": best}))
    logs = tmp_path / "logs" / "vllm_1p1d"  # under the Conductor: its breakdown too
    logs.mkdir(parents=True)
    (logs / "conductor.log").write_text(
        "x status=200 prefill=prefill-0 decode=decode-0 prompt=500 cached=0 out=1 "
        "finish=length ttft=1.0ms tbt=1.0ms queue=1.0ms prefix_load=0.0ms prefill=9.0ms "
        "transfer=1.0ms decode_wait=0.0ms conductor=0.1ms e2e=2.0ms\n")
    out = report.summarize(tmp_path)
    assert out["ratio_vllm_1p1d_vs_vllm"] == 1.5 and out["ratio_1p1d_vs_vllm_1p1d"] == 2.0
    assert out["systems"]["vllm_1p1d"]["breakdown_ms"]["0.15"]["prefill"]["mean"] == 9.0
    report.plot(tmp_path, out["systems"])
    assert (tmp_path / "capacity_vs_tbt.png").stat().st_size > 0


def test_report_merges_a_sweep_continued_in_another_dir(tmp_path: Path) -> None:
    first, later = tmp_path / "a", tmp_path / "b"
    for d in (first, later):
        d.mkdir()
    (first / "yuebing_1p1d.json").write_text(json.dumps(
        {"sweep": [{"rate": 0.2, "summary": _summary(0.85)}], "max_rate": None,
         "target_attainment": 0.9}))
    (first / "vllm_cpu.json").write_text(json.dumps(
        {"sweep": [{"rate": 0.1, "summary": _summary(0.6)}], "max_rate": None}))
    (later / "yuebing_1p1d.json").write_text(json.dumps(
        {"sweep": [{"rate": 0.15, "summary": _summary(0.95)}], "max_rate": 0.15}))
    out = report.summarize(first, [later])
    s = out["systems"]["yuebing_1p1d"]
    assert [r["rate"] for r in s["sweep"]] == [0.15, 0.2] and s["max_rate"] == 0.15
    assert out["ratio_max_rate_vs_vllm"] is None and out["ratio_max_rate_vs_vllm_above"] == 1.5
    (later / "vllm_cpu.json").write_text((first / "vllm_cpu.json").read_text())
    with pytest.raises(SystemExit, match="also swept"):
        report.summarize(first, [later])


def test_sim_vs_live_stats_and_compare(tmp_path: Path) -> None:
    rec = tmp_path / "r.jsonl"
    rows = [{"rate": 0.5, "status": "ok", "ttft_s": t, "tbt_s": 0.1} for t in (1.0, 2.0, 3.0)]
    rows.append({"rate": 0.5, "status": "error", "ttft_s": None, "tbt_s": None})
    rec.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    live = svl.live_stats(rec)[0.5]
    assert (live["ttft_p50"], live["ttft_p90"], live["completed"]) == (2.0, 3.0, 3)
    cmp = svl.compare(live, {**live, "ttft_p50": 2.6})
    assert cmp["ttft_p50"]["error"] == 0.3 and not cmp["ttft_p50"]["within"]
    assert cmp["tbt_p90"]["within"]
    assert math.isnan(svl.pct([], 0.5))


def test_sim_vs_live_step_check_against_the_predictor(tmp_path: Path) -> None:
    from yuebing.conductor.policy.predictors import (
        DecodePredictor,
        Predictors,
        PrefillPredictor,
        TransferPredictor,
        save_predictors,
    )

    def step(b: int, c: int) -> float:  # the "profiled" decode step: 20 ms + 1 ms/seq + 2 us/token
        return 0.02 + 0.001 * b + 2e-6 * c

    prefill = PrefillPredictor.fit([(n, c, 1e-3 * n + 1e-6 * c + 1e-9 * n * n)
                                    for n in (64, 256, 1024) for c in (0, 512, 2048)])
    decode = DecodePredictor.fit([(b, c, step(b, c)) for b in (1, 2, 4) for c in (256, 1024, 4096)])
    profile = tmp_path / "pred.json"
    save_predictors(Predictors(prefill, decode, TransferPredictor()), profile)
    # live: batch-1 steps 10 % slower than profiled, 0.5 ms between back-to-back steps; batch 2
    # as profiled; a prefill step and an idle pause are not decode intervals
    t, rows = 100.0, []
    for k in range(30):
        for b, slow in ((1, 1.1), (2, 1.0)):
            s = step(b, 1000 + k) * slow
            rows.append({"t": t, "step_s": s, "decodes": b, "prefill_tokens": 0,
                         "context_tokens": 1000 + k})
            t += s + 0.0005
    rows.append({"t": t, "step_s": 0.5, "decodes": 0, "prefill_tokens": 512, "context_tokens": 0})
    rows.append({"t": t + 60, "step_s": 0.02, "decodes": 1, "prefill_tokens": 0,
                 "context_tokens": 10})
    steps = tmp_path / "decode-0.steps.jsonl"
    steps.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    check = svl.step_check(steps, profile)
    assert check["by_batch"]["1"]["steps"] == 31 and check["by_batch"]["2"]["steps"] == 30
    assert check["by_batch"]["1"]["ratio"] == pytest.approx(1.1, abs=0.01)
    assert check["by_batch"]["2"]["ratio"] == pytest.approx(1.0, abs=0.005)
    assert check["outside_step_ms"]["p50"] == pytest.approx(0.5, abs=1e-3)
    assert check["outside_step_ms"]["p99"] < 1  # the 60 s pause is not a step interval
    assert "| 1 | 31 |" in svl.steps_table(check)


@pytest.mark.skipif(not TRACE.is_file(), reason="conversation trace not in ../shared/traces")
@pytest.mark.parametrize("max_output", [128, 16])
def test_sim_workload_is_the_load_generators(max_output: int) -> None:
    from yuebing.bench.config import BenchConfig
    from yuebing.bench.workload import build_workload
    from yuebing.trace.io import load_trace

    sim = svl.workload(TRACE, 20, 0.5, 0, max_output)
    cfg = BenchConfig(block_tokens=64, max_input=4096, max_output=max_output, limit=20, rate=0.5)
    live = build_workload(load_trace(TRACE), cfg)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in sim] == \
        [(b.send_s, b.input_tokens, b.max_tokens) for b in live]
    assert max(r.output_tokens for r in sim) == max_output  # the cap is reached, and holds
    assert all(len(r.block_keys) == -(-r.input_tokens // 64) for r in sim)
