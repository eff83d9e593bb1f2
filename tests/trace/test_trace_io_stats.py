"""Loading/validation, writing, stats and transforms of yuebing.trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yuebing.core.errors import ConfigError, InputError, TraceFormatError
from yuebing.trace.io import load_trace, write_trace
from yuebing.trace.model import Request, Trace
from yuebing.trace.stats import trace_stats
from yuebing.trace.transform import filter_trace, retime_poisson, scale_lengths, scale_time

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(("line", "field", "problem"), [
    ('{"timestamp": 0, "input_length": 10', "(line)", "invalid JSON"),
    ('[1, 2]', "(line)", "expected a JSON object, got `array`"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids",
     "missing required field"),
    ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": []}',
     "input_length", "expected `int`, got `str`"),
    ('{"timestamp": 1.5, "input_length": 10, "output_length": 1, "hash_ids": []}',
     "timestamp", "expected `int`, got `float`"),
    ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": []}',
     "output_length", "expected `int` >= 0"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "x"]}',
     "hash_ids[1]", "expected `int`, got `str`"),
    ('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1, 2, 3]}',
     "hash_ids", "3 block ids but input_length 513 covers only 2 blocks of 512 tokens"),
])
def test_malformed_line_names_file_line_field(tmp_path: Path, line: str, field: str,
                                              problem: str) -> None:
    p = write_lines(tmp_path, [json.dumps(GOOD), "", line, json.dumps(GOOD)])
    with pytest.raises(TraceFormatError) as info:
        load_trace(p)
    err = info.value
    assert (err.path, err.line, err.field) == (str(p), 3, field)
    assert str(err).startswith(f"{p}:3: field {field!r}: {problem}")


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceFormatError, match="holds no requests"):
        load_trace(write_lines(tmp_path, ["", "  "]))


def test_load_write_round_trip_and_extra_keys(tmp_path: Path) -> None:
    extra = dict(GOOD, timestamp=7, session="s1")  # unknown keys are ignored
    t = load_trace(write_lines(tmp_path, [json.dumps(GOOD), json.dumps(extra)]))
    assert t.requests == (Request(0, 1000, 5, (0, 1)), Request(7, 1000, 5, (0, 1)))
    out = write_trace(t, tmp_path / "out.jsonl")
    assert out.read_text().splitlines()[1] == (
        '{"timestamp":7,"input_length":1000,"output_length":5,"hash_ids":[0,1]}')
    assert load_trace(out) == t


def tiny() -> Trace:
    return Trace((
        Request(1000, 1024, 10, (0, 1)),
        Request(3000, 600, 20, (0, 2)),
        Request(2000, 512, 30, (0,)),   # out of order in the file
        Request(5000, 2000, 40, (0, 1, 3, 4)),
    ))


def test_stats_tiny_trace() -> None:
    st = trace_stats(tiny())
    assert st.requests == 4
    assert st.input.mean == (1024 + 600 + 512 + 2000) / 4
    assert (st.input.p50, st.input.min, st.input.max, st.input.total) == (812.0, 512, 2000, 4136)
    assert st.input.p90 == pytest.approx(1707.2)  # numpy linear: 1024 + 0.7 * (2000 - 1024)
    assert (st.output.mean, st.output.p50, st.output.p99) == (25.0, 25.0, pytest.approx(39.7))
    assert st.duration_s == 4.0
    assert st.arrival_rate_per_s == 1.0
    assert st.out_of_order == 1
    # time order: (0,1) new,new; (0,) seen; (0,2) seen,new; (0,1,3,4) seen,seen,new,new
    assert (st.blocks, st.unique_blocks) == (9, 5)
    assert st.cache_ratio == 4 / 9


def test_stats_zero_duration() -> None:
    st = trace_stats(Trace((Request(5, 10, 1, (0,)),)))
    assert st.duration_s == 0.0 and st.arrival_rate_per_s is None


def test_scale_time_and_validation() -> None:
    t = scale_time(tiny(), 0.5)
    assert [r.timestamp for r in t.requests] == [500, 1500, 1000, 2500]
    assert scale_time(Trace((Request(3, 1, 1, ()),)), 0.5).requests[0].timestamp == 2  # half-even
    with pytest.raises(ConfigError, match="time factor must be a positive number"):
        scale_time(tiny(), 0)


def test_scale_lengths_keeps_sharing_consistent() -> None:
    t = Trace((Request(0, 1024, 10, (7, 8)), Request(1, 1024, 10, (7, 9))))
    up = scale_lengths(t, 2.0, 0.5)
    # block i of the scaled prompt comes from original block i // 2
    assert up.requests[0] == Request(0, 2048, 5, (0, 1, 2, 3))
    assert up.requests[1] == Request(1, 2048, 5, (0, 1, 4, 5))
    down = scale_lengths(Trace((Request(0, 2048, 4, (1, 2, 3, 4)), Request(0, 2048, 4, (1, 2, 5, 6)))),
                         0.5)
    assert down.requests[0] == Request(0, 1024, 4, (0, 1))  # from original blocks 0 and 2
    assert down.requests[1] == Request(0, 1024, 4, (0, 2))
    assert scale_lengths(tiny(), 1.0, 2.0).requests[0] == Request(1000, 1024, 20, (0, 1))


def test_retime_poisson_is_seeded_and_ordered() -> None:
    t = Trace(tuple(Request(i * 7 % 5, 10, 1, (i,)) for i in range(2000)))
    a, b = retime_poisson(t, 10.0, seed=3), retime_poisson(t, 10.0, seed=3)
    assert a == b
    assert a != retime_poisson(t, 10.0, seed=4)
    ts = [r.timestamp for r in a.requests]
    assert ts[0] == 0 and ts == sorted(ts)
    assert [r.hash_ids for r in a.requests] == [r.hash_ids for r in t.in_time_order()]
    assert 2000 / (ts[-1] / 1000) == pytest.approx(10.0, rel=0.1)
    with pytest.raises(ConfigError, match="arrival rate must be a positive number"):
        retime_poisson(t, -1.0)


def test_filter() -> None:
    t = tiny()
    w = filter_trace(t, start_ms=2000, end_ms=5000)
    assert [r.timestamp for r in w.requests] == [2000, 3000]
    assert [r.timestamp for r in filter_trace(t, min_input=600, max_input=1024).requests] == [
        1000, 3000]
    assert [r.output_length for r in filter_trace(t, min_output=25).requests] == [30, 40]
    rebased = filter_trace(t, start_ms=2000, limit=2, rebase=True)
    assert [r.timestamp for r in rebased.requests] == [0, 1000]
    with pytest.raises(ConfigError, match="empty time window"):
        filter_trace(t, start_ms=5, end_ms=5)
    with pytest.raises(ConfigError, match="min input length 10 is above max input length 5"):
        filter_trace(t, min_input=10, max_input=5)
