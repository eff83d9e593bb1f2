"""Regression on the released conversation trace, and the `yuebing trace` CLI contract."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from yuebing.cli.main import main
from yuebing.trace.hitrate import simulate_global, simulate_local
from yuebing.trace.io import load_trace
from yuebing.trace.stats import trace_stats

INPUT_TOKENS = 144_793_823


def test_real_trace_loads_fast_and_stats(conversation_trace: Path) -> None:
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        trace = load_trace(conversation_trace)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.5
    assert len(trace) == 12_031
    st = trace_stats(trace)
    assert (st.blocks, st.unique_blocks, st.input.total, st.output.total) == (
        288_500, 182_790, INPUT_TOKENS, 4_122_048)
    assert st.cache_ratio == pytest.approx(0.3664124783362218, abs=1e-9)
    assert st.duration_s == 3536.999 and st.out_of_order == 0


@pytest.mark.parametrize(("capacity", "hit_tokens", "rate"), [
    (1e6, 7_865_590, 0.054322690271117434),
    (3e6, 20_087_299, 0.1387303586838784),
    (1.6e7, 48_650_284, 0.3359969575497706),
    (math.inf, 54_098_411, 0.3736237491291324),
])
def test_real_trace_global_hit_rates(conversation_trace: Path, capacity: float,
                                     hit_tokens: int, rate: float) -> None:
    r = simulate_global(load_trace(conversation_trace), capacity)
    assert (r.hit_tokens, r.input_tokens) == (hit_tokens, INPUT_TOKENS)
    assert r.hit_rate == pytest.approx(rate, abs=1e-9)


def test_real_trace_local_hit_rates(conversation_trace: Path) -> None:
    trace = load_trace(conversation_trace)
    rr = simulate_local(trace, 1.6e7, 16, "round_robin")
    assert rr.hit_tokens == 10_452_654 and rr.loads == [752] * 15 + [751]
    assert rr.hit_rate == pytest.approx(0.07218991655465855, abs=1e-9)
    rnd = simulate_local(trace, 1.6e7, 16, "random", seed=0)
    assert rnd.hit_rate == pytest.approx(0.07624285878548838, abs=1e-9)
    # every request shares block 0, so longest-prefix routing sends all of them to cache 0
    ca = simulate_local(trace, 1.6e7, 16, "cache_aware")
    assert ca.loads == [12_031] + [0] * 15
    assert ca.hit_tokens == simulate_global(trace, 1e6).hit_tokens  # = one cache of 1e6 tokens


def test_cli_hit_rate_json_contract(conversation_trace: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "hit-rate", str(conversation_trace), "--capacity", "1e6,3e6",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["1000000", "3000000"]
    assert out["1000000"] == pytest.approx(0.054322690271117434, abs=1e-9)
    assert out["3000000"] == pytest.approx(0.1387303586838784, abs=1e-9)


def tiny(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.jsonl"
    rows = [(0, 1024, 3, [0, 1]), (1000, 600, 4, [0, 2]), (2000, 512, 5, [0])]
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                     "hash_ids": h}) + "\n" for t, n, o, h in rows))
    return p


def test_cli_entry_point_subprocess(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("yuebing")
    out = subprocess.run([str(exe), "trace", "hit-rate", str(tiny(tmp_path)), "--capacity",
                          "1024,inf", "--json"], capture_output=True, text=True, check=True)
    # (0,1) miss; (0,2) reuses 0 → 512; (0,) reuses 0 → 512 (both capacities)
    assert json.loads(out.stdout) == {"1024": 1024 / 2136, "inf": 1024 / 2136}


def test_cli_local_stats_and_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = str(tiny(tmp_path))
    assert main(["trace", "hit-rate", p, "--capacity", "2048", "--local", "2",
                 "--routing", "round_robin", "--json"]) == 0
    # c0: (0,1) miss, (0,) hit 512; c1: (0,2) miss
    assert json.loads(capsys.readouterr().out) == {"2048": 512 / 2136}
    assert main(["trace", "stats", p, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["requests"], st["blocks"], st["unique_blocks"], st["duration_s"]) == (3, 5, 3, 2.0)
    assert main(["trace", "hit-rate", p, "--capacity", "1Ki"]) == 0
    assert "hit rate" in capsys.readouterr().out
    assert main(["trace", "stats", p]) == 0
    assert "cache ratio" in capsys.readouterr().out


def test_cli_transforms_and_synth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = str(tiny(tmp_path))
    out = tmp_path / "o.jsonl"
    assert main(["trace", "scale", p, "--out", str(out), "--speed", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "requests": 3}
    assert [r.timestamp for r in load_trace(out).requests] == [0, 500, 1000]
    assert main(["trace", "retime", p, "--out", str(out), "--rate", "4", "--seed", "1"]) == 0
    assert load_trace(out).requests[0].timestamp == 0
    assert main(["trace", "filter", p, "--out", str(out), "--start-ms", "500", "--rebase"]) == 0
    assert [r.timestamp for r in load_trace(out).requests] == [0, 1000]
    assert main(["trace", "synth", "fixed", "--out", str(out), "--requests", "10",
                 "--input-tokens", "2048", "--shared-fraction", "0.5"]) == 0
    assert trace_stats(load_trace(out)).cache_ratio == 9 * 2 / 40
    assert main(["trace", "synth", "docqa", "--out", str(out), "--documents", "2"]) == 0
    assert len(load_trace(out)) == 40
    capsys.readouterr()


def test_cli_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from yuebing.trace.prompts import PromptSynthesizer

    out = tmp_path / "p.jsonl"
    assert main(["trace", "prompts", str(tiny(tmp_path)), "--out", str(out), "--limit", "2",
                 "--low", "10", "--high", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "requests": 2}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["timestamp"], r["output_length"]) for r in rows] == [(0, 0, 3),
                                                                               (1, 1000, 4)]
    a, b = rows[0]["prompt_token_ids"], rows[1]["prompt_token_ids"]
    assert (len(a), len(b)) == (1024, 600)
    assert a[:512] == b[:512] == PromptSynthesizer(low=10, high=20).block(0)
    assert a[512:600] != b[512:600]
    assert main(["trace", "prompts", str(tiny(tmp_path)), "--out", str(tmp_path / "no/x"),
                 "--limit", "1"]) == 2
    assert "cannot write prompts" in capsys.readouterr().err


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}\n'
                   '{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": []}\n')
    out = tmp_path / "never.jsonl"
    assert main(["trace", "scale", str(bad), "--out", str(out), "--speed", "2"]) == 2
    assert f"{bad}:2: field 'input_length'" in capsys.readouterr().err
    assert not out.exists()
    p = str(tiny(tmp_path))
    assert main(["trace", "hit-rate", p, "--capacity", "lots"]) == 2
    assert "cannot parse size 'lots'" in capsys.readouterr().err
    assert main(["trace", "hit-rate", p, "--capacity", "1e6", "--local", "2",
                 "--routing", "nearest"]) == 2
    assert "unknown routing rule 'nearest'" in capsys.readouterr().err
    assert main(["trace", "hit-rate", p, "--capacity", "1e6", "--routing", "random"]) == 2
    assert "--routing applies only to --local N caches" in capsys.readouterr().err
    assert main(["trace", "filter", p, "--out", str(out), "--start-ms", "10000000"]) == 2
    assert f"no request is left to write to {str(out)!r}" in capsys.readouterr().err
    assert main(["trace", "synth", "fixed", "--out", str(out), "--shared-fraction", "2"]) == 2
    assert "shared_fraction must be in [0, 1]" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("argv", [
    ["trace", "hit-rate", "TRACE", "--capacity", "1e6", "--local", "2", "--routing", "random",
     "--seed", "-1"],
    ["trace", "retime", "TRACE", "--out", "OUT", "--rate", "1", "--seed", "-3"],
    ["trace", "synth", "fixed", "--out", "OUT", "--seed", "-1"],
    ["trace", "synth", "docqa", "--out", "OUT", "--seed", "-1"],
])
def test_cli_negative_seed_exits_2_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    out = tmp_path / "never.jsonl"
    subst = {"TRACE": str(tiny(tmp_path)), "OUT": str(out)}
    assert main([subst.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "seed must be >= 0, got -" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_library_rejects_negative_seed() -> None:
    from yuebing.core.errors import ConfigError
    from yuebing.trace.hitrate import RandomRouter
    from yuebing.trace.transform import poisson_arrivals

    with pytest.raises(ConfigError, match="seed must be >= 0, got -1"):
        RandomRouter(2, seed=-1)
    with pytest.raises(ConfigError, match="need at least one cache to route to, got 0"):
        RandomRouter(0)
    with pytest.raises(ConfigError, match="seed must be >= 0, got -2"):
        poisson_arrivals(3, 1.0, -2)
