"""``yuebing bench serve`` end to end against the fake endpoint: JSON report, records, plots,
rate sweeps, and one-line errors (status 2) before any load for every kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai_fake import FakeServer

from yuebing.cli.main import main
from yuebing.trace.io import write_trace
from yuebing.trace.model import Request, Trace

_SMALL_DOCQA = ["--synth", "docqa", "--docqa-documents", "2", "--docqa-questions-per-document",
                "3", "--docqa-min-document-tokens", "1024", "--docqa-max-document-tokens",
                "2048", "--docqa-question-tokens", "64", "--docqa-output-tokens", "4",
                "--block-tokens", "32"]


def _serve(fake: FakeServer, *args: str) -> list[str]:
    return ["bench", "serve", "--endpoint", fake.url, "--no-progress", *args]


def _one_line_error(capsys: pytest.CaptureFixture[str], code: int, match: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("yuebing: error: ")
    assert match in err, err


def test_json_report_records_and_cdf_plots(fake: FakeServer, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "records.jsonl"
    code = main(_serve(fake, *_SMALL_DOCQA, "--docqa-rate-per-s", "100", "--max-output", "3",
                       "--slo-tbt", "0.5,1", "--json", "--records", str(records),
                       "--plot", str(tmp_path / "plots")))
    assert code == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"] == "fake-model" and rep["workload"].startswith("synth:docqa")
    s = rep["summary"]
    assert (s["requests"], s["completed"]) == (6, 6)
    assert set(s["capacity"]) == {"500", "1000"} and len(s["slo"]) == 2
    assert s["tokens"]["output"] == 18  # --max-output 3 caps the 4 of the workload
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(6))
    assert all(x["status"] == "ok" and x["rate"] is None for x in lines)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["tbt_cdf.png",
                                                                      "ttft_cdf.png"]


def test_sweep_reports_each_rate_and_the_max(fake: FakeServer, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(_serve(fake, *_SMALL_DOCQA, "--sweep-rates", "200,100", "--json",
                       "--plot", str(tmp_path), "--slo-ttft", "300", "--slo-tbt", "300"))
    assert code == 0
    rep = json.loads(capsys.readouterr().out)
    assert [run["rate"] for run in rep["sweep"]] == [100.0, 200.0]
    assert all(run["summary"]["completed"] == 6 for run in rep["sweep"])
    assert rep["target_attainment"] == 0.9 and rep["max_rate"] == 200.0
    assert (tmp_path / "attainment_vs_rate.png").stat().st_size > 0
    assert len(fake.bodies) == 12
    first, second = ({tuple(b["prompt"]) for b in fake.bodies[k:k + 6]} for k in (0, 6))
    assert not first & second  # the second run does not find the first's prompts cached


def test_sweep_stops_at_the_first_missed_rate(fake: FakeServer,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fake.behaviour.actions = {0: "500"}  # 1 of 6 fails: attainment 5/6 < 0.9 at the first rate
    code = main(_serve(fake, *_SMALL_DOCQA, "--sweep-rates", "100,200", "--stop-on-miss",
                       "--slo-ttft", "300", "--slo-tbt", "300", "--json"))
    rep = json.loads(capsys.readouterr().out)
    assert code == 0 and [run["rate"] for run in rep["sweep"]] == [100.0]
    assert rep["max_rate"] is None and len(fake.bodies) == 6


def test_sweep_down_cuts_a_decided_rate_short_and_stops_at_the_first_pass(
        fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The first POST (rate 40's first request) fails at once while every other request takes
    # 0.2 s: one miss of six already caps that run at 5/6 < 0.9, so it stops sending then.
    fake.behaviour.actions = {0: "500"}
    fake.behaviour.first_token_delay_s = 0.2
    code = main(_serve(fake, *_SMALL_DOCQA, "--sweep-rates", "10,20,40", "--sweep-down",
                       "--stop-when-decided", "--slo-ttft", "300", "--slo-tbt", "300", "--json",
                       "--plot", str(tmp_path)))
    rep = json.loads(capsys.readouterr().out)
    assert code == 0 and [run["rate"] for run in rep["sweep"]] == [40.0, 20.0]  # 10 not run
    cut = rep["sweep"][0]["summary"]
    assert cut["cut_short"] == {"answered": 1, "of": 6, "missed": 1,
                                "attainment_at_most": 5 / 6}
    assert cut["attainment"] == 5 / 6 and cut["errors"] == 1
    assert cut["capacity"] == {"300000": 5 / 6} and cut["slo"][0]["attainment"] == 5 / 6
    assert "cut_short" not in rep["sweep"][1]["summary"]
    assert rep["sweep"][1]["summary"]["attainment"] == 1.0 and rep["max_rate"] == 20.0
    assert 7 <= len(fake.bodies) < 12  # rate 40 stopped sending; rate 20 sent all six
    assert (tmp_path / "attainment_vs_rate.png").stat().st_size > 0


@pytest.mark.parametrize(("args", "match"), [
    (("--sweep-rates", "1,2", "--sweep-down", "--stop-on-miss"), "choose one"),
    (("--sweep-down",), "give it"),
    (("--concurrency", "2", "--stop-when-decided"), "needs an open-loop run"),
])
def test_sweep_flags_that_cannot_apply_are_refused(
        fake: FakeServer, capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
        match: str) -> None:
    code = main(_serve(fake, *_SMALL_DOCQA, *args))
    _one_line_error(capsys, code, match)
    assert fake.bodies == []


def test_tables_on_the_terminal(fake: FakeServer, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(Trace(tuple(Request(i, 600, 2, (i,)) for i in range(3))), trace)
    fake.behaviour.actions = {1: "500"}
    assert main(_serve(fake, str(trace), "--rate", "50", "--block-tokens", "16")) == 0
    out = capsys.readouterr().out
    assert "50 req/s" in out and "SLO attainment" in out and "'http_500': 1" in out
    assert main(_serve(fake, str(trace), "--concurrency", "2", "--block-tokens", "16")) == 0
    assert "2 in flight" in capsys.readouterr().out


def test_bad_trace_fails_before_any_load(fake: FakeServer, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n')
    code = main(_serve(fake, str(bad), "--plot", str(tmp_path / "plots")))
    _one_line_error(capsys, code, "field 'hash_ids'")
    assert fake.bodies == [] and not (tmp_path / "plots").exists()  # nothing was changed


def test_unknown_model_fails_before_any_load(fake: FakeServer,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(_serve(fake, *_SMALL_DOCQA, "--model", "gpt-9"))
    _one_line_error(capsys, code, "not --model 'gpt-9'")
    assert fake.bodies == []


def test_unreachable_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["bench", "serve", *_SMALL_DOCQA, "--endpoint", f"http://127.0.0.1:{port}"])
    _one_line_error(capsys, code, "cannot reach --endpoint")


@pytest.mark.parametrize(("args", "match"), [
    ([], "give a trace file or --synth"),
    (["--synth", "fixed", "--docqa-documents", "3"],
     "--docqa-documents applies only to --synth docqa"),
    (["--synth", "fixed", "--sweep-rates", "1,x"], "--sweep-rates takes numbers"),
    (["--synth", "fixed", "--sweep-rates", "1,1"], "repeats a rate"),
    (["--synth", "fixed", "--sweep-rates", "1", "--rate", "2"], "drop --rate"),
    (["--synth", "fixed", "--sweep-rates", "1", "--speed", "2"], "drop --rate"),
    (["--synth", "fixed", "--api", "chat"], "chat messages are text"),
    (["--synth", "fixed", "--fixed-shared-fraction", "2"], "shared_fraction must be in [0, 1]"),
    (["--synth", "fixed", "--records", "/nonexistent/dir/r.jsonl"], "does not exist"),
    (["--synth", "fixed", "--plot", "/proc/version/plots"], "cannot create the directory"),
])
def test_bad_options_fail_before_any_load(fake: FakeServer, capsys: pytest.CaptureFixture[str],
                                          args: list[str], match: str) -> None:
    _one_line_error(capsys, main(_serve(fake, *args)), match)
    assert fake.bodies == []


def test_ctrl_c_reports_what_was_answered(fake: FakeServer) -> None:
    """SIGINT mid-run: the requests in flight are dropped, the JSON report covers the answered
    ones and says so, the exit status is 130."""
    import signal
    import subprocess
    import sys
    import time

    fake.behaviour.token_delay_s = 0.05  # 40 tokens: 2 s per request, far past the SIGINT
    proc = subprocess.Popen(
        [sys.executable, "-m", "yuebing.cli.main", *_serve(fake, *_SMALL_DOCQA,
                                                             "--docqa-output-tokens", "40",
                                                             "--concurrency", "2", "--json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # pytest started in the background by a non-interactive shell (as CI may run it) has
        # SIGINT ignored, and a child would inherit that: give the client the default back
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while len(fake.bodies) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    rep = json.loads(out)
    assert rep["interrupted"] is True
    assert rep["summary"]["requests"] < 6 and len(fake.bodies) < 6
