"""Numbers too big for a trace (issue 15 item 18): a precise one-line error and exit status 2,
never an OverflowError traceback or a hang; nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from yuebing.cli.main import main

LINE = '{{"timestamp": {ts}, "input_length": {n}, "output_length": 5, "hash_ids": [1]}}\n'


def _trace(tmp_path: Path, ts: str = "0", n: str = "1000") -> str:
    p = tmp_path / "t.jsonl"
    p.write_text(LINE.format(ts=0, n=600) + LINE.format(ts=ts, n=n))
    return str(p)


@pytest.mark.parametrize("ts,n,msg", [
    ("100000000000000000000", "10", "t.jsonl:2: field 'timestamp': expected `int` <= "
                                    "1000000000000000"),
    ("1e20", "10", "t.jsonl:2: field 'timestamp': expected `int`, got `float`"),
    ("5", "1000000000000000000000000000000", "t.jsonl:2: field 'input_length': expected "
                                             "`int` <= 2147483647"),
    ("5", "1e30", "t.jsonl:2: field 'input_length': expected `int`, got `float`"),
])
@pytest.mark.parametrize("command", ["stats", "hit-rate"])
def test_huge_numbers_in_a_trace_exit_2(tmp_path, capsys, ts, n, msg, command):
    extra = ["--capacity", "1e6"] if command == "hit-rate" else []
    assert main(["trace", command, _trace(tmp_path, ts, n), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("yuebing: error: ") and msg in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,msg", [
    (["scale", "--time-factor", "1e300"], "time factor 1e+300 puts the last arrival at"),
    (["scale", "--input-factor", "1e300"], "input length factor 1e+300 makes a request of"),
    (["scale", "--output-factor", "1e12"], "output length factor 1e+12 makes a request of"),
    (["retime", "--rate", "1e-300"], "arrival rate 1e-300/s puts the last of 2 arrivals"),
])
def test_transforms_that_would_overflow_exit_2(tmp_path, capsys, argv, msg):
    out = tmp_path / "out.jsonl"
    assert main(["trace", argv[0], _trace(tmp_path, ts="100"), "--out", str(out), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert msg in err and "a trace may hold" in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("argv,msg", [
    (["fixed", "--input-tokens", str(10**20)], "input_tokens must be in 1..2147483647"),
    (["fixed", "--output-tokens", str(10**20)], "output_tokens must be in 0..2147483647"),
    (["docqa", "--max-document-tokens", "3000000000"],
     "max_document_tokens + question_tokens must be <= 2147483647"),
    (["fixed", "--requests", "3", "--rate-per-s", "1e-300"], "arrival rate 1e-300/s"),
])
def test_synth_bounds_exit_2(tmp_path, capsys, argv, msg):
    out = tmp_path / "out.jsonl"
    assert main(["trace", "synth", argv[0], "--out", str(out), *argv[1:]]) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()
