"""`parse_log_line` reads back what `RequestStats.log_line` writes: the benchmarks parse the
Conductor's access log through it (overload_live's waste and prefill slowdown,
serve_vs_vllm_report's breakdown), so a change to the line's format breaks this test, not a
benchmark's silent regex."""

from __future__ import annotations

import pytest

from yuebing.conductor.stats import RequestStats, parse_log_line
from yuebing.protocol.instance import Breakdown


def test_an_access_line_reads_back_field_by_field() -> None:
    s = RequestStats("r1", arrival_s=10.0, prompt_tokens=845, completion_tokens=128,
                     cached_tokens=64, prefill_id="prefill-0", decode_id="decode-0",
                     first_token_s=10.36, end_s=17.03, finish_reason="length",
                     breakdown=Breakdown(queue_s=0.002, prefix_load_s=0.004, prefill_s=0.3205,
                                         transfer_s=0.012, decode_wait_s=0.0015))
    line = "2026-11-30 10:58:01,123 INFO yuebing.conductor.access: " + s.log_line(200)
    f = parse_log_line(line)
    assert f is not None
    assert {k: f[k] for k in ("status", "prefill_id", "decode_id", "prompt", "cached", "out")} \
        == {"status": 200, "prefill_id": "prefill-0", "decode_id": "decode-0", "prompt": 845,
            "cached": 64, "out": 128}
    assert f["ttft"] == pytest.approx(s.ttft_s, abs=1e-4)
    assert f["e2e"] == pytest.approx(s.e2e_s, abs=1e-4)
    assert f["queue"] == pytest.approx(s.queue_s, abs=1e-4)
    for name in ("prefix_load", "prefill", "transfer", "decode_wait"):
        assert f[name] == pytest.approx(getattr(s.breakdown, f"{name}_s"), abs=1e-4), name


def test_older_lines_without_the_tail_and_other_lines() -> None:
    old = ("r2 status=429 prefill=- decode=- prompt=5 cached=0 out=0 finish=x ttft=0.0ms "
           "tbt=0.0ms queue=0.0ms prefix_load=0.0ms prefill=0.0ms")
    f = parse_log_line(old)
    assert f is not None and f["status"] == 429 and "e2e" not in f and f["prefill"] == 0.0
    assert parse_log_line("2026-11-30 INFO yuebing.conductor: started") is None
