"""The whole paper report on the full conversation trace (slow) and its targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yuebing.sim.paper import fig1, fig5, overload
from yuebing.sim.paper.report import gap, run_figures, write_report


@pytest.mark.slow
def test_full_report_meets_the_simulator_targets(conversation_trace: Path,
                                                 tmp_path: Path) -> None:
    report = run_figures(["5", "1", "overload"], conversation_trace, tmp_path, fast=False)
    paths = write_report(report, tmp_path, fast=False)
    assert json.loads(paths[0].read_text())["5"]["ours"] == report["5"]["ours"]
    assert (tmp_path / "fig5_ttft_by_policy.png").stat().st_size > 0
    ttft = report["5"]["ours"]
    assert ttft["random"] > ttft["load_balance"] > ttft["local_cache_aware"] \
        > ttft["global_cache_aware"]
    ours, paper = fig5.ratios(ttft), fig5.ratios(fig5.PAPER)
    for name in ("random", "load_balance", "local_cache_aware"):
        assert abs(ours[name] / paper[name] - 1) <= 0.30, (name, ours[name], paper[name])
    fig1_ours = report["1"]["ours"]
    mooncake = fig1_ours["mooncake"]
    assert mooncake["100"] >= 0.90 and mooncake["200"] >= 0.98 and mooncake["300"] >= 0.98
    # the targets Figure 1 meets (docs/reproduction.md): vLLM and + prefix caching within
    # ±20 pp at every threshold, + chunked prefill at 100 ms (its 200/300 ms are missed)
    met = [("vllm", t) for t in ("100", "200", "300")]
    met += [("vllm_prefix_caching", t) for t in ("100", "200", "300")]
    met += [("vllm_chunked_prefill", "100")]
    for name, t in met:
        paper = fig1.PAPER[name]
        assert paper is not None and abs(fig1_ours[name][t] - paper[t]) <= 0.20, (name, t)
    assert set(report["1"]["details"]["by_speed"]) == {"1", "1.25", "1.5", "1.75", "2"}
    assert (tmp_path / "fig1_speed_sensitivity.png").stat().st_size > 0
    assert set(report["overload"]["ours"]) == {"baseline", "early_rejection",
                                              "predictive_early_rejection"}
    # decode-bound variant: prediction rejects fewer than plain early rejection and damps the
    # prefill-load oscillation (20-300 s band variance); baseline > early is missed
    label = f"{overload.VARIANT[0]}P+{overload.VARIANT[1]}D"
    early = report["overload"]["details"][f"{label} early_rejection"]
    pred = report["overload"]["details"][f"{label} predictive_early_rejection"]
    assert pred["rejected"] < early["rejected"]
    assert pred["prefill_load_band_var"] < 0.8 * early["prefill_load_band_var"]


@pytest.mark.slow
def test_fast_report_writes_every_artifact(conversation_trace: Path, tmp_path: Path) -> None:
    report = run_figures(["5", "10", "11", "14", "15"], conversation_trace, tmp_path, fast=True)
    write_report(report, tmp_path, fast=True)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "report.json", "report.md", "fig5_ttft_by_policy.png", "fig10_global_vs_local.png",
        "fig11_hot_replicas.png", "fig14_single_request.png", "fig15_load_breakdown.png"}
    md = (tmp_path / "report.md").read_text()
    assert "| random | 19.6 |" in md
    # every number with a paper value beside it has its gap in %
    row = next(line for line in md.splitlines() if line.startswith("| prefill_no_cache_s.8k |"))
    assert row == "| prefill_no_cache_s.8k | 1 | 1.04 | +4 % |"
    assert "| by_rank.10.max_replicas | 8 |" in md
    # local vs global cache on 10 prefill nodes: the global pool hits more and computes less
    f10 = report["10"]["ours"]
    assert f10["global"]["hit_rate"] > f10["local"]["hit_rate"]
    assert f10["global"]["prefill_gpu_s_per_request"] < f10["local"]["prefill_gpu_s_per_request"]


def test_gap_is_relative_to_the_paper_and_only_for_numbers() -> None:
    assert gap(3.0, 2.0) == 0.5 and gap(1.5, 2.0) == -0.25
    assert gap(1.0, None) is None and gap(None, 1.0) is None and gap(1.0, 0) is None
    assert gap(True, 1.0) is None and gap(float("nan"), 1.0) is None
