"""The whole paper report on the full conversation trace (slow) and its targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yuebing.sim.paper import fig1, fig5
from yuebing.sim.paper.report import gap, run_figures, write_report


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ≈ 20 runs of the whole trace: minutes, more on a loaded machine
def test_full_report_meets_the_simulator_targets(conversation_trace: Path,
                                                 tmp_path: Path) -> None:
    """The calibrated results of docs/reproduction.md, pinned with the tolerances the targets
    allow (met) or with the direction of the documented gap (missed)."""
    report = run_figures(["5", "1", "8", "overload"], conversation_trace, tmp_path, fast=False)
    paths = write_report(report, tmp_path, fast=False)
    assert json.loads(paths[0].read_text())["5"]["ours"] == report["5"]["ours"]
    assert (tmp_path / "fig5_ttft_by_policy.png").stat().st_size > 0
    ttft = report["5"]["ours"]
    assert ttft["random"] > ttft["load_balance"] > ttft["local_cache_aware"] \
        > ttft["global_cache_aware"]
    ours, paper = fig5.ratios(ttft), fig5.ratios(fig5.PAPER)
    for name in ("random", "load_balance", "local_cache_aware"):
        assert abs(ours[name] / paper[name] - 1) <= 0.20, (name, ours[name], paper[name])
    # absolute TTFTs are about half the paper's at the trace's own pace (gap 1): the compute is
    # the paper's, the waiting is not (the paper: 2 s at 45 % busy; ours: 0.36 s at 55 %)
    assert 0.4 <= ttft["global_cache_aware"] / fig5.PAPER["global_cache_aware"] <= 0.6
    f5 = report["5"]["compare"]
    assert f5["paper"]["global_prefill_busy_share"] == pytest.approx(0.45, abs=0.01)
    assert f5["ours"]["global_prefill_busy_share"] > f5["paper"]["global_prefill_busy_share"]
    assert f5["ours"]["global_waiting_s"] < 0.25 * f5["paper"]["global_waiting_s"]
    fig1_ours = report["1"]["ours"]
    tolerance_pp = {"mooncake": 0.03, "vllm": 0.10, "vllm_prefix_caching": 0.15}
    for name, tol in tolerance_pp.items():
        for t in ("100", "200", "300"):
            paper_value = fig1.PAPER[name]
            assert paper_value is not None and abs(fig1_ours[name][t] - paper_value[t]) <= tol
    # chunked prefill keeps far more than the paper at 200/300 ms (gap 4)
    assert fig1_ours["vllm_chunked_prefill"]["200"] > 0.9
    assert set(report["1"]["details"]["by_speed"]) == {"1", "1.25", "1.5", "2"}
    assert (tmp_path / "fig1_speed_sensitivity.png").stat().st_size > 0
    # Figure 8: Mooncake's prefill GPU time per request within ±25 % of the paper's 1.06 s and
    # below every baseline's
    f8 = report["8"]["ours"]
    assert abs(f8["mooncake"] / 1.06 - 1) <= 0.25
    assert all(f8["mooncake"] < f8[n] for n in ("vllm", "vllm_prefix_caching"))
    # overload on 8P+8D: decode never binds, every policy rejects about the same TTFT misses
    rejected = report["overload"]["ours"]
    assert set(rejected) == {"baseline", "early_rejection", "predictive_early_rejection"}
    assert max(rejected.values()) <= 1.02 * min(rejected.values())
    # on the decode-bound 8P+2D the baseline, which keeps a backlog of prefilled requests at
    # the decode nodes, serves what the decode pool can: prediction rejects about as many
    # (gap 4) and damps the oscillation that plain early rejection starts (which over-rejects)
    variant = report["overload"]["details"]["8P+2D"]
    base, early, pred = (variant[k] for k in ("baseline", "early_rejection",
                                              "predictive_early_rejection"))
    assert abs(pred["rejected"] / base["rejected"] - 1) <= 0.05 < early["rejected"] / base[
        "rejected"] - 1
    assert early["prefill_load_band_var"] > 2 * base["prefill_load_band_var"]
    assert pred["prefill_load_band_var"] < 1.5 * base["prefill_load_band_var"]
    # where both pools bind, the prefill more (7P+2D), prediction saves the baseline's wasted
    # prefill and rejects fewer (paper −14 %); plain early rejection still over-rejects
    both = report["overload"]["details"]["7P+2D"]
    base, early, pred = (both[k]["rejected"] for k in ("baseline", "early_rejection",
                                                       "predictive_early_rejection"))
    assert pred < 0.96 * base < early
    assert report["overload"]["details"]["workload"]["mean_input"] == pytest.approx(7590,
                                                                                    rel=0.01)


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


def test_derived_comparisons_get_rows_with_their_gap(tmp_path: Path) -> None:
    ours = {"random": 8.0, "load_balance": 2.0, "local_cache_aware": 1.5,
            "global_cache_aware": 1.0}
    details = {"ratio_to_global": fig5.ratios(ours)}
    report = {"5": {"ours": ours, "paper": fig5.PAPER, "details": details,
                    "compare": fig5.comparisons(ours, details)}}
    write_report(report, tmp_path, fast=True)
    md = (tmp_path / "report.md").read_text()
    # paper: 19.65 / 3.07 = 6.4; ours 8.0: gap +25 %
    assert "| ratio_to_global.random | 6.4 | 8 | +25 % |" in md
    assert json.loads((tmp_path / "report.json").read_text())["5"]["compare"]["paper"][
        "ratio_to_global"]["global_cache_aware"] == 1.0


def test_fig5_comparisons_put_the_global_runs_waiting_and_load_beside_the_papers() -> None:
    ours = {"random": 8.0, "load_balance": 2.0, "local_cache_aware": 1.5,
            "global_cache_aware": 1.5}
    where = {p: {"queue_s": 0.25, "prefill_s": 1.2, "prefill_busy_share": 0.5,
                 "to_decode_start_s": 1.5} for p in fig5.POLICIES}
    details = {"ratio_to_global": fig5.ratios(ours), "where_time_goes": where,
               "paper_global_waiting_s": 2.01, "paper_prefill_busy_share": 0.45}
    compare = fig5.comparisons(ours, details)
    assert compare["ours"]["global_waiting_s"] == pytest.approx(0.3)
    assert compare["ours"]["global_prefill_busy_share"] == 0.5
    assert (compare["paper"]["global_waiting_s"], compare["paper"]["global_prefill_busy_share"]) \
        == (2.01, 0.45)


def test_overload_comparisons_put_shares_and_changes_beside_the_paper() -> None:
    from yuebing.sim.paper import overload

    variant = {"baseline": {"rejected": 100}, "early_rejection": {"rejected": 90},
               "predictive_early_rejection": {"rejected": 80}}
    details = {"rejected_share": {"baseline": 0.1}, "paper_rejected_share": {"baseline": 0.18},
               "vs_baseline": {"baseline": 0.0}, "paper_vs_baseline": {"early_rejection": -0.1},
               "8P+2D": variant}
    rows = overload.comparisons({"baseline": 1}, details)
    assert rows["ours"]["8P+2D_vs_baseline"] == {  # type: ignore[index]
        "baseline": 0.0, "early_rejection": pytest.approx(-0.1),
        "predictive_early_rejection": pytest.approx(-0.2)}
    assert rows["paper"]["8P+2D_vs_baseline"] == {"early_rejection": -0.1}  # type: ignore[index]
    assert "7P+2D_vs_baseline" not in rows["ours"]  # type: ignore[operator]
    details["7P+2D"] = {"baseline": {"rejected": 50}, "early_rejection": {"rejected": 60}}
    rows = overload.comparisons({"baseline": 1}, details)
    assert rows["ours"]["7P+2D_vs_baseline"] == {  # type: ignore[index]
        "baseline": 0.0, "early_rejection": pytest.approx(0.2)}
