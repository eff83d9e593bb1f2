"""`benchmarks/overload_live.py` without clusters: bad arguments exit 2 with one line before any
load, and its bookkeeping (rejection stages, thrown-away prefill, goodput, verdicts, the
simulated run) on given records."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "overload_live.py"
spec = importlib.util.spec_from_file_location("overload_live", SCRIPT)
assert spec is not None and spec.loader is not None
ol: Any = importlib.util.module_from_spec(spec)
sys.modules["overload_live"] = ol
spec.loader.exec_module(ol)


@pytest.mark.parametrize("args, says", [
    (["--multipliers", "2,0"], "--multipliers"),
    (["--base-rate", "-1"], "--base-rate"),
    (["--find-rates", "x"], "--find-rates"),
    (["--policies", "none,bogus"], "bogus not offered"),
    (["--policies", "none,early_rejection,none"], "names a policy twice"),
    (["--retry-policy", "bogus"], "--retry-policy"),
    (["--topologies", "1P0D"], "1P0D"),
    (["--requests", "0"], "--requests"),
    (["--repeats", "0"], "--repeats"),
    (["--ttft-slo-s", "nan"], "--ttft-slo-s"),
    (["--sim-only", "--topologies", "1P1D", "--base-rate", "0.3"], "--sim-only needs"),
    (["--tbt-tail", "0.5"], "--tbt-tail"),
    (["--sim-stretch", "0.5"], "--sim-stretch"),
    (["--sim-step-tail", "0.9"], "--sim-step-tail"),
    (["--predictors", "/nonexistent/p.json"], "--predictors: no file"),
    (["--topologies", "1P1D,2P1D", "--predictors", "a,b,c"], "3 paths for 2 topologies"),
    (["--resim", "/nonexistent"], "--resim: no /nonexistent/overload_live.json"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert not out.exists()  # nothing started, nothing written


@pytest.fixture
def trace(conversation_trace: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The released trace the benchmark replays (the test skips where ../shared has none)."""
    monkeypatch.setattr(ol, "TRACE", conversation_trace)
    return conversation_trace


def _setup(tmp_path: Path) -> Any:
    return ol.Setup(tmp_path, requests=4, seed=0, max_input=512, max_output=16, ttft_slo_s=2.0,
                    tbt_slo_s=0.1, sample_s=1.0, timeout_s=30.0, port=1)


def _record(i: int, status: str, ttft: float | None = None, tbt: float | None = None,
            end: float = 10.0, retries: int = 0) -> dict[str, Any]:
    return {"index": i, "scheduled_s": float(i), "status": status, "error": "" if status == "ok"
            else ("rejected" if status == "rejected" else "timeout"), "ttft_s": ttft,
            "tbt_s": tbt, "end_s": end, "retries": retries}


def test_live_summary_counts_goodput_stages_waste_and_retries(tmp_path: Path) -> None:
    log = tmp_path / "conductor.log"
    line = ("x INFO yuebing.conductor.access: cmpl-{i} status={st} prefill=prefill-0 "
            "decode=decode-0 prompt={p} cached={c} out=4 finish=length ttft={t}ms tbt=20.0ms "
            "queue=1.0ms prefix_load=0.0ms prefill={pf}ms transfer=1.0ms decode_wait=1.0ms "
            "conductor=0.5ms e2e=9.0ms est_ttft=1.0ms est_prefill=1.0ms\n")
    log.write_text(line.format(i=0, st=200, p=1000, c=200, t=500.0, pf=400.0)      # within SLO
                   + line.format(i=1, st=200, p=600, c=0, t=3000.0, pf=300.0)      # late: waste
                   + line.format(i=2, st=499, p=700, c=0, t=0.0, pf=0.0)           # never prefilled
                   + line.format(i=3, st=499, p=300, c=100, t=0.0, pf=50.0))       # cut off: waste
    waste = ol.wasted_prefill(log, 2.0, 0.1)
    assert waste == {"prefilled_tokens": 800 + 600 + 200, "wasted_tokens": 600 + 200}
    rows = [_record(0, "ok", 0.5, 0.02, end=4.0), _record(1, "ok", 3.0, 0.02, end=8.0),
            _record(2, "rejected", end=2.5, retries=2), _record(3, "ok", 1.0, 0.02, end=5.0,
                                                               retries=1)]
    metrics = ('yuebing:rejected_requests_total{reason="prefill_overload"} 3.0\n'
               'yuebing:rejected_requests_total{reason="decode_kv_full"} 1.0\n')
    reasons = ol.rejected_by_reason(metrics)
    samples = [{"t": 1.0, "prefill": 0.5, "decode": 0.2}, {"t": 2.0, "prefill": 1.5,
                                                          "decode": 0.2}]
    out = ol.summarize_live(_setup(tmp_path), rows, reasons, samples, waste, retry=True)
    assert (out["answered"], out["within_slo"], out["rejected"]) == (3, 2, 1)
    assert out["goodput_rps"] == pytest.approx(2 / 8.0)  # span: first send (0) to last end (8)
    assert out["rejections_by_stage"] == {"arrival": 3, "reserve": 1}
    assert (out["retried"], out["retried_then_answered"], out["retried_then_within_slo"]) == \
        (2, 1, 1)
    assert out["load"]["prefill"]["swing"] == pytest.approx(1.0)
    assert out["latency"]["ttft_p50"] == 1.0 and "verdict" not in out
    none = ol.summarize_live(_setup(tmp_path), [_record(0, "rejected")], {}, [], waste)
    assert none["verdict"] == "the cluster rejected every request"
    silent = ol.summarize_live(_setup(tmp_path), [_record(0, "error")], {}, [], waste)
    assert silent["verdict"] == "the cluster answered no request"


def test_checks_compare_policies_at_2x() -> None:
    def run(policy: str, goodput: float, wasted: int, swing: float, sim: float) -> dict:
        return {"multiplier": 2.0, "policy": policy, "sim": {"goodput_rps": sim},
                "live": {"goodput_rps": goodput, "wasted_tokens": wasted,
                         "load": {"prefill": {"swing": swing}}}}
    result = {"topologies": [{"name": "1P1D", "runs": [
        run("none", 0.2, 1000, 0.3, 0.25), run("early_rejection", 0.3, 600, 0.2, 0.28),
        run("predictive_early_rejection", 0.35, 400, 0.1, 0.3)]}]}
    c = ol.checks(result)
    assert c["1P1D goodput pred >= early >= none"] == "True"
    assert c["1P1D rejecting policies >= 1.2x none"] == "True"
    assert c["1P1D thrown-away prefill pred <= 0.5x none"].startswith("True")
    assert c["1P1D prefill swing pred < early"].startswith("True")
    assert c["1P1D sim order matches live"].startswith("True")
    assert "none +25%" in c["1P1D sim goodput within ±25 %"]


def test_checks_compare_the_means_over_repeats() -> None:
    def run(policy: str, goodput: float) -> dict:
        return {"multiplier": 2.0, "policy": policy, "sim": {"goodput_rps": goodput},
                "live": {"goodput_rps": goodput, "wasted_tokens": 10,
                         "load": {"prefill": {"swing": 0.1}}}}
    runs = [run("none", 0.2), run("early_rejection", 0.5), run("predictive_early_rejection", 0.3),
            run("none", 0.2), run("early_rejection", 0.1), run("predictive_early_rejection", 0.4)]
    c = ol.checks({"topologies": [{"name": "1P1D", "runs": runs}]})
    assert c["1P1D goodput pred >= early >= none"] == "True"  # 0.35 >= 0.3 >= 0.2
    assert c["1P1D rejecting policies >= 1.2x none"] == "True"


def test_paired_interval_and_spread_table_on_paired_seeds() -> None:
    """Differences per seed +0.1, +0.1, +0.4: mean +0.2; every bootstrap mean lies in
    [0.1, 0.4], and the 90 % interval inside it."""
    m, lo, hi = ol.paired_interval([0.3, 0.2, 0.5], [0.2, 0.1, 0.1])
    assert m == pytest.approx(0.2) and 0.1 - 1e-9 <= lo <= m <= hi <= 0.4 + 1e-9 and lo < hi
    with pytest.raises(ValueError):
        ol.paired_interval([0.1], [0.1, 0.2])
    text = ol.spread_table({"none": [0.2, 0.1, 0.1], "early_rejection": [0.3, 0.2, 0.5]}, "x")
    assert "| 3 seeds | none | 0.133 (0.100–0.200) | – | – |" in text
    assert "| 3 seeds | early_rejection | 0.333 (0.200–0.500) | 2.50× | +0.200 (" in text


def test_spreads_pair_the_runs_of_one_seed() -> None:
    def run(policy: str, seed: int, goodput: float) -> dict:
        return {"multiplier": 2.0, "policy": policy, "seed": seed,
                "live": {"goodput_rps": goodput}, "sim": {"goodput_rps": math.nan}}
    runs = [run("none", 1, 0.1), run("early_rejection", 1, 0.3),
            run("none", 0, 0.2), run("early_rejection", 0, 0.2)]
    text = ol.spreads({"topologies": [{"name": "1P1D", "runs": runs}]})
    assert "1P1D 2× live" in text and "sim" not in text  # no finite simulated goodput
    assert "| 2 seeds | early_rejection | 0.250 (0.200–0.300) | 1.67× | +0.100 (" in text


def _predictors(tmp_path: Path, prefill_s_per_token: float, decode_step_s: float,
                decode_s_per_sequence: float = 0.0) -> Path:
    """A predictor file profiled on a 2-core machine with 64-token prefill chunks: prefill
    linear in new tokens, a decode step of a constant plus, if given, a term per sequence in
    the batch."""
    from yuebing.conductor.policy import (
        BivariatePolynomial,
        DecodePredictor,
        Predictors,
        PrefillPredictor,
        TransferPredictor,
    )
    from yuebing.conductor.policy.predictors import save_predictors

    path = tmp_path / "p.json"
    save_predictors(Predictors(
        PrefillPredictor(BivariatePolynomial(((1, 0),), (prefill_s_per_token,))),
        DecodePredictor(BivariatePolynomial(((0, 0), (1, 0)),
                                            (decode_step_s, decode_s_per_sequence))),
        TransferPredictor(), "test", {"machine": "Test CPU | amx_bf16 | 2 cores",
                                      "max_batch_tokens": "64"}), path)
    return path


@pytest.mark.usefixtures("trace")
def test_simulated_run_uses_the_bench_requests_and_the_given_predictors(tmp_path: Path) -> None:
    path = _predictors(tmp_path, 1e-4, 0.01)
    setup = _setup(tmp_path)
    reqs = ol.sim_requests(setup, 1.0)
    assert len(reqs) == 4 and max(r.input_tokens for r in reqs) <= 512
    assert all(r.output_tokens <= 16 for r in reqs)
    out = ol.sim_run(setup, (1, 1), "early_rejection", 1.0, path)
    assert out["requests"] == 4 and out["within_slo"] == 4 and out["rejected"] == 0
    assert out["goodput_rps"] > 0 and out["samples"]


@pytest.mark.usefixtures("trace")
def test_simulated_nodes_share_the_profiled_machines_cores(tmp_path: Path) -> None:
    """The simulated cluster runs on one host of the predictors' 2 cores, one thread each:
    1P1D steps at its profile beside a prefill (and the policy's tail does not slow it), and
    so does 2P1D (the decode's core reserved, the prefills take turns on the other); in 1P2D
    the decodes outnumber their reservation, so a step beside the prefill waits for its
    64-token chunk (128 ms) to end; ``stretch`` (a measured factor) multiplies the steps
    beside a prefill and the prefills beside a step."""
    path = _predictors(tmp_path, 2e-3, 0.02)
    assert ol.host_cores(path) == 2
    setup = replace(_setup(tmp_path), requests=8)
    alone = ol.sim_run(setup, (1, 1), "none", 4.0, path, tail=3.0)
    assert alone["latency"]["tbt_p99"] < 0.025  # steps of 20 ms (+ the KV hand-over)
    shared = ol.sim_run(setup, (2, 1), "none", 4.0, path, tail=3.0)
    assert shared["latency"]["tbt_p99"] < 0.025
    crowded = ol.sim_run(setup, (1, 2), "none", 4.0, path, tail=3.0)
    assert 0.1 < crowded["latency"]["tbt_p99"] <= 0.02 + 0.128 + 0.02
    mated = ol.sim_run(setup, (1, 1), "none", 4.0, path, stretch=3.0)
    assert mated["latency"]["tbt_p99"] > 0.05  # steps during a prefill take 3 x 20 ms
    factors = json.loads((tmp_path / "interference.json").read_text())["interference"]
    assert factors == {"decode_factor": 3.0, "prefill_factor": 3.0}


@pytest.mark.usefixtures("trace")
def test_simulated_decode_steps_carry_the_given_tail_drawn_from_the_seed(tmp_path: Path) -> None:
    """``step_tail``: a tenth of the simulated decode steps take it times their profiled time
    (`SimConfig.decode_tail`), drawn from the run's seed; off (1) unless given."""
    path = _predictors(tmp_path, 1e-4, 0.02)
    setup = replace(_setup(tmp_path), requests=8, max_output=64)
    even = ol.simulated(setup, (1, 1), "none", 0.5, path, 1.0, 1.0)
    assert even.config.decode_tail == 1.0
    tailed = ol.simulated(setup, (1, 1), "none", 0.5, path, 1.0, 1.0, step_tail=2.5)
    again = ol.simulated(setup, (1, 1), "none", 0.5, path, 1.0, 1.0, step_tail=2.5)
    other = ol.simulated(replace(setup, seed=1), (1, 1), "none", 0.5, path, 1.0, 1.0,
                         step_tail=2.5)
    assert tailed.config.decode_tail == 2.5 and tailed.config.policy.seed == 0
    assert other.config.policy.seed == 1
    assert [r.tbt_s for r in tailed.records] == [r.tbt_s for r in again.records]
    slower = sorted(t.tbt_s / e.tbt_s for t, e in zip(tailed.records, even.records, strict=True))
    assert slower[len(slower) // 2] > 1.5  # most requests' slowest tenth: slow steps
    out = ol.sim_run(setup, (1, 1), "none", 0.5, path, step_tail=2.5)
    assert out["latency"] == ol.sim_run(setup, (1, 1), "none", 0.5, path, 1.0, 1.0, (),
                                        2.5)["latency"]
    assert out["tbt_tail"] == 1.0  # 8 requests: fewer than a Conductor learns from


def test_the_simulator_fits_the_start_up_profiles_of_a_clusters_logs(tmp_path: Path) -> None:
    """``--predictors LOGDIR``: the prefill and decode predictors fitted to the start-up
    profiles in the instances' ready files, as the Conductor fits them before any online
    scale; a directory without them is a one-line error."""
    from yuebing.conductor.calibration import fit_profile
    from yuebing.conductor.policy import Predictors
    from yuebing.protocol.instance import EngineProfile

    conf = {"threads": "1", "machine": "Test CPU | amx_bf16 | 2 cores"}
    prefill = [[128, 0, 0.16], [512, 0, 0.35], [1536, 0, 1.06], [4096, 0, 5.3],
               [128, 1024, 0.18], [512, 1024, 0.37], [1536, 1024, 0.95], [4096, 1024, 7.0]]
    decode = [[1, 512, 0.024], [1, 4096, 0.034], [8, 512, 0.039], [8, 4096, 0.086],
              [32, 512, 0.103], [32, 4096, 0.106]]
    logs = tmp_path / "logs"
    logs.mkdir()
    for role, pre, dec in (("prefill-0", prefill, []), ("decode-0", [], decode)):
        (logs / f"{role}.ready.json").write_text(json.dumps({"profile": {
            "type": "inst.engine_profile", "configuration": conf, "prefill": pre,
            "decode": dec, "v": 1}}))
    out = ol.sim_predictors(logs, tmp_path / "fit.json")
    assert out == tmp_path / "fit.json"
    got = Predictors.from_json(out.read_bytes())
    want = EngineProfile(configuration=conf,
                         prefill=[(int(n), int(c), float(t)) for n, c, t in prefill],
                         decode=[(int(b), int(c), float(t)) for b, c, t in decode])
    assert got.prefill.predict(845, 0) == pytest.approx(
        fit_profile(want, "prefill").predict(845, 0))
    assert got.decode.predict(8, 8000) == pytest.approx(fit_profile(want, "decode").predict(8, 8000))
    assert got.configuration["machine"] == conf["machine"] and ol.host_cores(out) == 2
    assert ol.sim_predictors(out, tmp_path / "unused.json") == out  # a file: as is
    (logs / "decode-0.ready.json").unlink()
    with pytest.raises(ValueError, match="decode-0.ready.json: no start-up profile"):
        ol.sim_predictors(logs, tmp_path / "fit2.json")


def test_plot_leaves_out_a_topology_that_found_no_rate(tmp_path: Path) -> None:
    """2P1D passed no searched rate (so it has a verdict and no runs): 1P1D's plots are still
    drawn, where the run used to end in an IndexError before its report was written."""
    samples = [{"t": 1.0, "prefill": 0.2, "decode": 0.4}, {"t": 2.0, "prefill": 0.1,
                                                          "decode": 0.5}]
    runs = [{"multiplier": 2.0, "policy": p, "repeat": 0, "sim": {"goodput_rps": 0.2},
             "live": {"goodput_rps": 0.3, "samples": samples, "wasted_tokens": 0,
                      "load": {"prefill": {"swing": 0.1}}}}
            for p in ("none", "early_rejection")]
    result = {"topologies": [
        {"name": "1P1D", "max_rate": 0.3, "policies": ["none", "early_rejection"], "runs": runs},
        {"name": "2P1D", "policies": ["none", "early_rejection"], "runs": [],
         "verdict": "no rate of [0.3] reached 90% attainment; give lower --find-rates"}]}
    ol.plot(result, tmp_path)
    assert (tmp_path / "overload_load_1P1D.png").stat().st_size > 0
    assert (tmp_path / "overload_goodput.png").stat().st_size > 0
    assert not (tmp_path / "overload_load_2P1D.png").exists()


def test_each_cluster_starts_from_its_own_copy_of_the_warm_up_state(tmp_path: Path) -> None:
    """``--learned warm``: every measured Conductor gets ``--learned-dir`` on a fresh copy of
    the warm-up state of its decode selector (what it writes is its own); none kept for its
    selector (or ``cold``): an empty one."""
    from dataclasses import replace

    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "k.json").write_text('{"parts": {}, "learned": {}}')
    setup = replace(_setup(tmp_path), learned_from=(("forecast", warm),))
    logs = tmp_path / "logs" / "run"
    (logs / "learned").mkdir(parents=True)
    (logs / "learned" / "stale.json").write_text("{}")  # a previous invocation's
    c = ol.Cluster(setup, (1, 1), "predictive_early_rejection", logs)
    i = c.argv.index("--learned-dir")
    assert c.argv[i + 1] == str(logs / "learned")
    assert c.argv[c.argv.index("--decode-selector") + 1] == "forecast"
    assert sorted(p.name for p in (logs / "learned").iterdir()) == ["k.json"]
    other = ol.Cluster(setup, (1, 1), "early_rejection", logs)
    assert other.argv[other.argv.index("--decode-selector") + 1] == "least_loaded"
    assert other.argv[i + 1] == str(logs / "learned") and not any((logs / "learned").iterdir())
    warmup = ol.Cluster(setup, (1, 1), "none", logs, selector="forecast")
    assert warmup.argv[warmup.argv.index("--decode-selector") + 1] == "forecast"
    assert (warm / "k.json").exists()


@pytest.mark.usefixtures("trace")
def test_the_simulated_forecast_assumes_the_durations_a_warm_up_realizes(tmp_path: Path) -> None:
    """``--sim-durations warm``: the simulated policy forecasts with the decode durations (first
    token to last) of a simulated ``none`` run, as the live Conductor learns them in its
    warm-up, not the outputs times a loaded node's step capped at the TBT SLO (here 0.1 s a
    token against a realized 20-30 ms)."""
    from yuebing.conductor.policy.decode import duration_quantiles

    path = _predictors(tmp_path, 1e-4, 0.02, 0.005)  # decode step 20 ms + 5 ms per sequence
    setup = _setup(tmp_path)
    learned = ol.warm_durations(setup, (1, 1), 1.0, path, 1.0, 1.0)
    run = ol.simulated(setup, (1, 1), "none", 1.0, path, 1.0, 1.0)
    seconds = [r.finish_s - r.first_token_s for r in run.records]
    assert learned == duration_quantiles(seconds, 4) and len(learned) == 4
    for r in run.records:  # 25-30 ms a token, not the SLO's 100 ms
        assert 0.024 * (r.output_tokens - 1) <= r.finish_s - r.first_token_s \
            <= 0.031 * r.output_tokens
    own = ol.simulated(setup, (1, 1), "predictive_early_rejection", 1.0, path, 1.0, 1.0)
    given = ol.simulated(setup, (1, 1), "predictive_early_rejection", 1.0, path, 1.0, 1.0,
                         learned)
    assert own.config.forecast_durations_s == () and given.config.forecast_durations_s == learned
    assert ol.sim_run(setup, (1, 1), "predictive_early_rejection", 1.0, path, 1.0, 1.0,
                      learned)["requests"] == 4


def _live_result(tmp_path: Path, policies: tuple[str, ...]) -> tuple[Path, Path]:
    """A finished live run's OUTDIR (1P1D at 2x, seed 0, one run per policy, the search's
    tail 1.8, each run's 1.5) and an empty OUTDIR for `resim`."""
    rows = [_record(i, "ok", ttft=0.5, tbt=0.05) for i in range(4)]
    live = ol.summarize_live(_setup(tmp_path), rows, {}, [], {"prefilled_tokens": 9,
                                                                "wasted_tokens": 0})
    runs = [{"multiplier": 2.0, "rate": 1.0, "policy": p, "repeat": 0, "seed": 0,
             "live": {**live, "tbt_tail": 1.5}, "sim": {"goodput_rps": 0.0}} for p in policies]
    setup = {"requests": 4, "seed": 0, "max_input": 512, "max_output": 16, "ttft_slo_s": 2.0,
             "tbt_slo_s": 0.1, "sample_s": 1.0, "timeout_s": 30.0, "repeats": 1}
    src, out = tmp_path / "live", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "overload_live.json").write_text(json.dumps(
        {"setup": setup, "topologies": [{"name": "1P1D", "max_rate": 0.5, "tbt_tail": 1.8,
                                         "runs": runs}]}))
    return src, out


@pytest.mark.usefixtures("trace")
def test_resim_runs_the_simulator_columns_of_a_live_run_again(tmp_path: Path) -> None:
    """``--resim DIR``: each run's simulator column again on the live run's workload, with the
    tail its seed's live ``none`` run learned for the policy and the one its rate search
    learned for the decode steps (or the one given); the checks compare the new columns."""
    path = _predictors(tmp_path, 1e-4, 0.01)
    src, out = _live_result(tmp_path, ("none", "early_rejection", "predictive_early_rejection"))
    assert ol.resim(src, out, [path], 1.0, True, 1.4) == 0
    assert json.loads((out / "overload_live.json").read_text())["topologies"][0][
        "sim_step_tail"] == 1.4
    assert ol.resim(src, out, [path], 1.0, True) == 0
    again = json.loads((out / "overload_live.json").read_text())
    assert again["topologies"][0]["sim_step_tail"] == 1.8  # the search's: no warm-up
    sims = [r["sim"] for r in again["topologies"][0]["runs"]]
    assert all(s["requests"] == 4 and s["goodput_rps"] > 0 for s in sims)
    assert "1P1D sim goodput within ±25 %" in again["checks"]
    assert "| 1P1D 2× sim |" in (out / "overload_live.md").read_text()
    assert ol.resim(src, out, [], 1.0, False) == 2  # no <cluster>-max logs to fit
    assert ol.resim(src, out, [path], 0.0, True) == 0  # measure it: no rate search's log
    assert json.loads((out / "overload_live.json").read_text())["topologies"][0][
        "sim_stretch"] == 1.0
    logs = src / "logs" / "1P1D-max"
    logs.mkdir(parents=True)
    (logs / "conductor.log").write_text(_access(10.0, "prefill-0", 1000, 0, 150.0))
    assert ol.resim(src, out, [path], 0.0, True) == 0
    again = json.loads((out / "overload_live.json").read_text())
    assert again["topologies"][0]["sim_stretch"] == pytest.approx(1.5)
    assert again["checks"]["1P1D sim engines beside each other / decode steps' tail"] == \
        "x1.500 / 1.800"


def _access(end_s: float, node: str, prompt: int, cached: int, prefill_ms: float,
            status: int = 200) -> str:
    """A Conductor access line logged ``end_s`` after 08:00 (1 s end to end, no queue)."""
    m, sec = divmod(end_s, 60)
    when = f"2026-11-30 08:{int(m):02d}:{sec:06.3f}".replace(".", ",")
    return (f"{when} INFO yuebing.conductor.access: cmpl-1 status={status} prefill={node} "
            f"decode=decode-0 prompt={prompt} cached={cached} out=16 finish=length "
            f"ttft=300.0ms tbt=50.0ms queue=0.0ms prefix_load=0.0ms prefill={prefill_ms:.1f}ms "
            f"transfer=1.0ms decode_wait=1.0ms conductor=1.00ms e2e=1000.0ms est_ttft=1.0ms "
            f"est_prefill=1.0ms\n")


def test_prefill_slowdown_is_the_median_of_live_over_profiled_prefills_alone(
        tmp_path: Path) -> None:
    """The rate search's live prefills over the start-up profile's (1 ms per new token): the
    median over answered requests predicted at least 50 ms whose prefill overlapped no other
    prefill instance's (c and f overlap: they took turns on a core); at least 1, 1 without a
    log."""
    path = _predictors(tmp_path, 1e-3, 0.02)
    lines = [_access(10.0, "prefill-0", 100, 0, 150.0),       # a: 1.5
             _access(20.0, "prefill-0", 264, 64, 400.0),      # b: 200 new tokens, 2.0
             _access(30.0, "prefill-0", 300, 0, 330.0),       # c: 1.1, beside f
             _access(30.1, "prefill-1", 100, 0, 100.0),       # f: 1.0, beside c
             _access(40.0, "prefill-0", 100, 0, 170.0),       # g: 1.7
             _access(50.0, "prefill-0", 40, 0, 400.0),        # predicted 40 ms: fixed costs
             _access(60.0, "prefill-0", 100, 0, 900.0, 503)]  # not answered
    log = tmp_path / "conductor.log"
    log.write_text("".join(lines))
    assert ol.prefill_slowdown(log, path) == pytest.approx(1.7)
    assert ol.prefill_slowdown(tmp_path / "none.log", path) == 1.0
    log.write_text(_access(10.0, "prefill-0", 100, 0, 80.0))
    assert ol.prefill_slowdown(log, path) == 1.0  # faster than the profile: no slowdown


def test_the_report_names_the_machine_as_the_predictors_do_and_its_speed_readably() -> None:
    from yuebing.core.host import cpu_name

    assert ol.machine().startswith(cpu_name() + ", ") and ol.machine().endswith(" cores")
    speeds = {"start": {"python_ns": 23.031, "copy_gbps": 6.129},
              "end": {"python_ns": 24.364, "copy_gbps": 5.865}}
    assert ol.host_speed_text(speeds) == ("start 23.0 ns per Python loop, 6.13 GB/s copy; "
                                          "end 24.4 ns per Python loop, 5.87 GB/s copy")


def test_the_decode_steps_tail_is_the_warm_ups_at_the_runs_load_else_the_searchs() -> None:
    """The bug it guards: the sim's steps took the rate search's tail, learned at half the
    runs' load (2.53 where the 2x runs learned 1.56-1.99), and its goodput fell to a third of
    live; the warm-ups (admission none at the runs' load) learned 1.57 / 1.71. A warm-up whose
    Conductor learned nothing reports its start, 1.0, and is left out."""
    topo = {"tbt_tail": 2.53, "warmup": {"forecast": {"tbt_tail": 1.571},
                                         "least_loaded": {"tbt_tail": 1.705}}}
    assert ol.step_tail_of(topo) == pytest.approx(1.638)
    assert ol.step_tail_of({"tbt_tail": 2.53, "warmup": {}}) == 2.53
    assert ol.step_tail_of({"tbt_tail": None}) == 1.0
    assert ol.step_tail_of({"tbt_tail": 2.0, "warmup": {"a": {"tbt_tail": 1.0},
                                                        "b": {"tbt_tail": 1.7}}}) == 1.7
    assert ol.step_tail_of({"tbt_tail": 2.0, "warmup": {"a": {"tbt_tail": 1.0}}}) == 2.0


def test_each_run_reports_its_first_requests_ttft_and_the_hosts_copy_rate() -> None:
    """Policies are compared across clusters that start minutes apart on a host whose speed
    moves: each run's row shows its cluster's first, lone request's TTFT and the host's copy
    rate measured before it started ("–" where a run lacks them, e.g. an older result)."""
    rows = [_record(1, "ok", ttft=0.9, tbt=0.05), _record(0, "ok", ttft=0.36, tbt=0.04)]
    assert ol.first_ttft(rows) == 0.36
    assert ol.first_ttft([_record(0, "rejected"), _record(1, "ok", ttft=0.5)]) is None
    live = {"goodput_rps": 0.5, "within_slo": 3, "requests": 4, "rejected": 0,
            "rejections_by_stage": {}, "wasted_tokens": 0, "prefilled_tokens": 9,
            "latency": {k: 0.1 for k in ("ttft_p50", "ttft_p99", "tbt_p99")},
            "load": {p: {"std": 0.1, "swing": 0.1} for p in ("prefill", "decode")}}
    run = {"multiplier": 2.0, "rate": 1.0, "policy": "none", "seed": 0,
           "sim": {"goodput_rps": 0.4}}
    result = {"topologies": [{"name": "1P1D", "runs": [
        {**run, "live": {**live, "first_ttft_s": 0.36, "host_speed": {"copy_gbps": 5.93}}},
        {**run, "live": live}]}]}
    rows_md = ol.table(result).splitlines()
    assert rows_md[0].endswith("| first TTFT (s) / host copy GB/s |")
    assert rows_md[2].endswith("| 0.36 / 5.9 |") and rows_md[3].endswith("| – / – |")


def test_each_seed_runs_the_policies_live_in_a_rotated_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed k starts its live runs at the k-th policy, so over as many seeds as policies each
    runs first, second and last once (a host that slows within a seed favours none); the runs
    are still reported policy by policy, each with its place."""
    from yuebing.core.host import HostSpeed

    calls: list[tuple[int, str]] = []
    rows = [_record(i, "ok", ttft=0.5, tbt=0.05) for i in range(4)]

    def fake_live_run(setup: Any, nodes: Any, policy: str, rate: float, name: str,
                      retry: bool = False, selector: str = "") -> dict[str, Any]:
        calls.append((setup.seed, policy))
        live = ol.summarize_live(setup, rows, {}, [], {"prefilled_tokens": 1,
                                                       "wasted_tokens": 0})
        return {**live, "tbt_tail": 1.0, "first_ttft_s": 0.5}

    monkeypatch.setattr(ol, "live_run", fake_live_run)
    monkeypatch.setattr(ol, "speed", lambda: HostSpeed(25.0, 6.0))  # no probes: quick
    monkeypatch.setattr(sys, "argv", ["overload_live.py", str(tmp_path / "out"), "--topologies",
                                      "1P1D", "--base-rate", "0.5", "--multipliers", "2",
                                      "--repeats", "4", "--no-sim", "--learned", "cold",
                                      "--retry-policy", ""])
    assert ol.main() == 0
    policies = ["none", "early_rejection", "predictive_early_rejection"]
    assert [p for _, p in calls] == [*policies, *policies[1:], policies[0], policies[2],
                                     *policies[:2], *policies]
    assert [s for s, _ in calls] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    runs = json.loads((tmp_path / "out" / "overload_live.json").read_text())[
        "topologies"][0]["runs"]
    assert [r["policy"] for r in runs] == policies * 4
    assert [r["live"]["order"] for r in runs[3:6]] == [3, 1, 2]


@pytest.mark.usefixtures("trace")
def test_resim_without_a_none_run_takes_the_searchs_tail(tmp_path: Path) -> None:
    """A live run whose ``--policies`` left out ``none`` is simulated again with the tail its
    rate search learned, as the live benchmark did, not a crash."""
    path = _predictors(tmp_path, 1e-4, 0.01)
    src, out = _live_result(tmp_path, ("early_rejection", "predictive_early_rejection"))
    assert ol.resim(src, out, [path], 1.0, True, 1.4) == 0
    sims = [r["sim"] for r in json.loads((out / "overload_live.json").read_text())[
        "topologies"][0]["runs"]]
    assert [s["requests"] for s in sims] == [4, 4]
