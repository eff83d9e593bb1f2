"""``yuebing sim run`` / ``yuebing sim paper``: JSON contracts and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yuebing.cli.main import main


def test_sim_run_json(conversation_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "run", str(conversation_trace), "--limit", "300", "--json",
               "--prefill-policy", "load_balance"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 300
    assert out["config"]["policy"]["prefill_selector"] == "load_balance"
    assert out["summary"]["completed"] + out["summary"]["rejected"] == 300
    assert set(out["summary"]["effective_capacity"]) == {"100", "200", "300"}
    assert out["events"] > 0 and out["events_per_s"] > 0


def test_sim_paper_figure5_json_keys(conversation_trace: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "paper", "--trace", str(conversation_trace), "--figure", "5", "--json",
               "--fast"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["random", "load_balance", "local_cache_aware", "global_cache_aware"]
    assert all(isinstance(v, float) and v > 0 for v in out.values())


def test_sim_paper_overload_json_keys_and_plots(conversation_trace: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "paper", "--trace", str(conversation_trace), "--figure", "overload",
               "--json", "--fast", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["baseline", "early_rejection", "predictive_early_rejection"]
    assert all(isinstance(v, int) and v >= 0 for v in out.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "overload_load.png", "overload_rejections.png", "report.json", "report.md"]
    assert json.loads((tmp_path / "report.json").read_text())["overload"]["ours"] == out


def test_bad_inputs_give_precise_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "paper", "--figure", "7", "--json"]) == 2
    assert "unknown figure '7'" in capsys.readouterr().err
    assert main(["sim", "run", str(tmp_path / "none.jsonl"), "--json"]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    assert main(["sim", "run", str(tmp_path / "none.jsonl"), "--speed", "0"]) == 2
    assert "speed must be > 0" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": []}\n')
    assert main(["sim", "run", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_bad_outputs_and_flags_fail_before_any_work(
        conversation_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = str(conversation_trace)
    records = tmp_path / "no" / "r.jsonl"
    assert main(["sim", "run", t, "--limit", "5", "--records", str(records)]) == 2
    assert f"directory '{records.parent}' does not exist" in capsys.readouterr().err
    assert main(["sim", "paper", "--figure", "", "--json"]) == 2  # not "every figure"
    assert "unknown figure ''" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["sim", "paper", "--trace", t, "--figure", "5", "--out", str(blocker / "d")]) == 2
    assert f"cannot create output directory '{blocker / 'd'}'" in capsys.readouterr().err
    for flags, message in ((["--systems", "mooncake,nope"], "unknown simulated system 'nope'"),
                           (["--systems", " , "], "name at least one system to time"),
                           (["--repeat", "0"], "repeat must be >= 1, got 0"),
                           (["--limit", "-2"], "limit must be >= 0 (0 = whole trace), got -2")):
        assert main(["bench", "sim", t, "--plot", str(tmp_path / "img" / "p.png"), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "img").exists()


def test_sim_run_writes_records(conversation_trace: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "r.jsonl"
    assert main(["sim", "run", str(conversation_trace), "--limit", "7", "--records",
                 str(records)]) == 0
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert [r["index"] for r in lines] == list(range(7))
    assert all(r["rejected"] is None and r["ttft_s"] > 0 for r in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_sim_run_with_a_fitted_profile(conversation_trace: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from yuebing.conductor.policy.predictors import save_predictors
    from yuebing.sim.hardware import RooflineCostModel
    from yuebing.sim.predict import predictors_for

    path = tmp_path / "predictors.json"
    save_predictors(predictors_for(RooflineCostModel()), path)
    args = ["sim", "run", str(conversation_trace), "--limit", "300", "--json"]
    assert main([*args, "--cost-model", "fitted", "--profile", str(path)]) == 0
    fitted = json.loads(capsys.readouterr().out)["summary"]
    assert main(args) == 0
    roofline = json.loads(capsys.readouterr().out)["summary"]
    # the predictors are a polynomial fit of the roofline: same workload, close outcome
    assert fitted["completed"] == roofline["completed"] == 300
    assert fitted["ttft_s"]["mean"] == pytest.approx(roofline["ttft_s"]["mean"], rel=0.25)


def _strict(text: str) -> object:
    def refuse(token: str) -> object:
        raise AssertionError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_json_is_standard_when_nothing_completes(conversation_trace: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "r.jsonl"
    assert main(["sim", "run", str(conversation_trace), "--limit", "6", "--json",
                 "--admission", "early_rejection", "--ttft-slo-s", "0.0001",
                 "--records", str(records)]) == 0
    out = _strict(capsys.readouterr().out)
    assert isinstance(out, dict)
    assert out["summary"]["rejected"] == 6
    assert out["summary"]["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    lines = [_strict(x) for x in records.read_text().splitlines()]
    assert [(r["rejected"], r["ttft_s"]) for r in lines] == [("arrival", None)] * 6  # type: ignore[index]
