"""The whole paper report on the full conversation trace (slow) and its targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yuebing.sim.paper import fig5
from yuebing.sim.paper.report import run_figures, write_report


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
    mooncake = report["1"]["ours"]["mooncake"]
    assert mooncake["100"] >= 0.90 and mooncake["200"] >= 0.98 and mooncake["300"] >= 0.98
    assert set(report["overload"]["ours"]) == {"baseline", "early_rejection",
                                              "predictive_early_rejection"}


def test_fast_report_writes_every_artifact(conversation_trace: Path, tmp_path: Path) -> None:
    report = run_figures(["5", "8", "10", "15"], conversation_trace, tmp_path, fast=True)
    write_report(report, tmp_path, fast=True)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "report.json", "report.md", "fig5_ttft_by_policy.png", "fig8_block_popularity.png",
        "fig10_hot_replicas.png", "fig15_load_breakdown.png"}
    md = (tmp_path / "report.md").read_text()
    assert "| random | 19.6 |" in md
    assert report["8"]["ours"]["max_uses"] == 2000   # block 0 is in every request
