"""The engine side-by-side benchmark harness: workload method, the worker protocol, the
alternating schedule, adjacent-pair ratios, merging and target verdicts (the peers themselves
are not run here)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from yuebing.ops.pgroup import group_alive, group_pids

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
        {"target": "decode tok/s at batch 8 >= 1x vLLM-CPU (issue 5)", "ratio": 0.5,
         "basis": "pooled", "met": False},
        {"target": "prefill tok/s at 512 >= 1.2x vLLM-CPU (issue 25)", "ratio": 2.0,
         "basis": "pooled", "met": True}]
    ep.print_table(merged, s, w)  # renders with an errored peer
    assert ep.markdown(merged, s, w).splitlines() == [
        "| metric | yuebing | vllm-cpu | ours/vllm-cpu adjacent | ours/vllm-cpu pooled |",
        "|---|---|---|---|---|",
        "| decode b=1 ms/step | 20.0 | 10.0 | - | 0.50 |",
        "| decode b=8 ms/step | 40.0 | 20.0 | - | 0.50 |",
        "| decode b=1 tok/s | 50.0 | 100.0 | - | 0.50 |",
        "| decode b=8 tok/s | 200.0 | 400.0 | - | 0.50 |",
        "| prefill 512 tok/s | 2000.0 | 1000.0 | - | 2.00 |"]
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


def test_schedule_pairs_ours_with_each_peer_and_alternates_who_goes_first() -> None:
    w = wl.Workload(batches=(8,), prefill_lens=(512,), repeats=2)
    slots = ep.schedule(["yuebing", "vllm-cpu", "transformers"], w, 0)
    assert [(s.kind, s.size, s.rep, s.names) for s in slots] == [
        ("decode", 8, 0, ("yuebing", "vllm-cpu")), ("decode", 8, 0, ("transformers", "yuebing")),
        ("decode", 8, 1, ("vllm-cpu", "yuebing")), ("decode", 8, 1, ("yuebing", "transformers")),
        ("prefill", 512, 0, ("yuebing", "vllm-cpu")),
        ("prefill", 512, 0, ("transformers", "yuebing")),
        ("prefill", 512, 1, ("vllm-cpu", "yuebing")),
        ("prefill", 512, 1, ("yuebing", "transformers"))]
    # both sides of a pair get the same prompts; every repeat and round fresh ones
    assert slots[0].tag == slots[1].tag == "d8R0r0" and slots[2].tag == "d8R0r1"
    again = ep.schedule(["yuebing", "vllm-cpu"], w, 1)
    assert [s.names for s in again][:2] == [("vllm-cpu", "yuebing"), ("yuebing", "vllm-cpu")]
    assert {s.tag for s in again}.isdisjoint({s.tag for s in slots})
    # ours first as often as the peer: over two rounds each order once per cell and repeat
    firsts = [s.names[0] for r in range(2) for s in ep.schedule(["yuebing", "vllm-cpu"], w, r)]
    assert firsts.count("yuebing") == firsts.count("vllm-cpu") == 4
    alone = ep.schedule(["vllm-cpu", "transformers"], w, 0)
    assert all(not s.pair for s in alone) and len(alone) == 8
    assert [s.names for s in ep.schedule(["yuebing"], w, 0)] == [("yuebing",)] * 4


class PhasedHost:
    """Workers on a host whose speed halves in its second phase: every call to ``sample``
    advances one tick, and ticks 8..15 run at half speed. Ours prefills 1.2x the peer's
    tokens/s and decodes at 0.8x its ms/step, at every speed."""

    def __init__(self) -> None:
        self.tick = 0

    def speed(self) -> float:
        return 0.5 if 8 <= self.tick % 16 < 16 else 1.0

    def worker(self, prefill_tps: float, decode_ms: float) -> Any:
        host = self

        class W:
            def sample(self, kind: str, size: int, tag: str) -> float:
                sp = host.speed()
                host.tick += 1
                return prefill_tps * sp if kind == "prefill" else decode_ms / sp

        return W()


def test_adjacent_pairs_recover_the_ratio_across_host_phases() -> None:
    """The host's speed halves for stretches of 8 samples: every adjacent pair lies within one
    stretch, so each pair's ratio is the true one whatever the phase."""
    w = wl.Workload(batches=(8,), prefill_lens=(512,), repeats=4)
    host = PhasedHost()
    workers = {"yuebing": host.worker(1200.0, 8.0), "vllm-cpu": host.worker(1000.0, 10.0)}
    infos = {"yuebing": {"v": 1}, "vllm-cpu": {"v": 2}}
    seen: list[tuple[str, str]] = []
    out = ep.take_samples(workers, infos, w, 2, 0.0, lambda sl, n: seen.append((sl.tag, n)))
    assert len(out.pairs) == 2 * 2 * 4 and len(seen) == 32
    adj = ep.adjacent_ratios(out.pairs)["vllm-cpu"]
    assert adj["prefill_512"]["median"] == pytest.approx(1.2)
    assert adj["decode_b8"]["median"] == pytest.approx(1.25)
    assert adj["prefill_512"]["n"] == 8 and len(adj["prefill_512"]["ratios"]) == 8
    assert adj["prefill_512"]["ours_first"] == pytest.approx(1.2)
    assert adj["prefill_512"]["peer_first"] == pytest.approx(1.2)
    assert adj["prefill_512"]["q25"] <= 1.2 <= adj["prefill_512"]["q75"]
    assert out.runs["yuebing"][0]["info"] == {"v": 1}
    assert len(out.runs["yuebing"][1]["prefill"]["512"]["samples_tokens_per_s"]) == 4
    merged = {n: ep.merge_runs(r) for n, r in out.runs.items()}
    s = ep.summarize(merged, w, ep.adjacent_ratios(out.pairs))
    assert [(t["basis"], t["met"]) for t in s["targets"]] == [("adjacent pairs", True),
                                                               ("adjacent pairs", True)]
    assert s["targets"][1]["ratio"] == pytest.approx(1.2)


def test_adjacent_ratios_statistics_and_order_split() -> None:
    def pair(first: str, ours: float, theirs: float, kind: str = "prefill") -> dict[str, Any]:
        return {"peer": "vllm-cpu", "kind": kind, "size": 512 if kind == "prefill" else 8,
                "first": first, "ours": ours, "theirs": theirs, "round": 0, "rep": 0}

    pairs = [pair("yuebing", 1100, 1000), pair("vllm-cpu", 1300, 1000),
             pair("yuebing", 1200, 1000), pair("vllm-cpu", 1400, 1000),
             pair("yuebing", 10.0, 0.0), pair("yuebing", -1.0, 5.0, "decode")]
    adj = ep.adjacent_ratios(pairs)["vllm-cpu"]
    p = adj["prefill_512"]
    assert p["ratios"] == pytest.approx([1.1, 1.3, 1.2, 1.4]) and p["n"] == 4
    assert p["median"] == pytest.approx(1.25)
    assert (p["q25"], p["q75"]) == (pytest.approx(1.175), pytest.approx(1.325))
    assert p["ours_first"] == pytest.approx(1.15) and p["peer_first"] == pytest.approx(1.35)
    # a pair with a sample not above 0 gives no ratio; a cell left without any says n/a
    assert adj["decode_b8"] == {"median": None, "q25": None, "q75": None, "n": 0, "ratios": [],
                                "ours_first": None, "peer_first": None}
    assert ep._adjacent_text(p) == "1.25 [1.17-1.33] n=4"
    assert ep._adjacent_text(adj["decode_b8"]) == "-"
    one = ep.adjacent_ratios([pair("yuebing", 1500, 1000)])["vllm-cpu"]["prefill_512"]
    assert (one["median"], one["q25"], one["q75"]) == (1.5, 1.5, 1.5)


def test_a_failing_peer_is_recorded_and_ours_goes_on() -> None:
    w = wl.Workload(batches=(1,), prefill_lens=(512,), repeats=2)

    class Ours:
        def sample(self, kind: str, size: int, tag: str) -> float:
            return 100.0

    class Dies:
        calls = 0

        def sample(self, kind: str, size: int, tag: str) -> float:
            self.calls += 1
            if self.calls > 1:
                raise ep.PeerFailed("exit status 3 at decode 1")
            return 50.0

    out = ep.take_samples({"yuebing": Ours(), "vllm-cpu": Dies()}, {"yuebing": {}, "vllm-cpu": {}},
                          w, 2, 0.0)
    assert len(out.pairs) == 1
    assert out.runs["vllm-cpu"] == [{"error": "exit status 3 at decode 1"}] * 2
    ours = out.runs["yuebing"]
    assert ours[0]["decode"]["1"]["samples_ms"] == [100.0, 100.0]
    assert ours[1]["prefill"]["512"]["samples_tokens_per_s"] == [100.0, 100.0]
    assert ep.merge_runs(out.runs["vllm-cpu"]) == {"error": "exit status 3 at decode 1"}


class Spinning:
    """A worker whose threads keep using the CPU for ``busy`` looks after its sample (as vLLM's
    OpenMP threads do), 0.05 s per look."""

    def __init__(self, busy: int) -> None:
        self.busy, self.used, self.looks = busy, 0.0, 0

    def cpu_seconds(self) -> float:
        self.looks += 1
        if self.looks <= self.busy:
            self.used += 0.05
        return self.used


def test_wait_idle_waits_until_no_worker_uses_the_cpu_up_to_a_cap() -> None:
    quiet, spinning = Spinning(0), Spinning(6)
    waited = ep.wait_idle({"a": quiet, "b": spinning, "c": object()}, 0.0, 5.0, window_s=0.01)
    # each window looks twice at every worker: the spinner is idle from its 4th window on
    assert spinning.looks == 8 and waited < 5.0
    assert ep.wait_idle({"b": Spinning(10 ** 6)}, 0.0, 0.05, window_s=0.01) >= 0.05
    assert ep.wait_idle({"n": object()}, 0.0, 5.0, window_s=0.01) < 1.0


FAKE_PEER = """
import sys, time
sys.path.insert(0, {peers!r})
from workload import Backend, main

class Instant(Backend):
    name = "instant"
    def __init__(self, model, w):
        assert model == "M"
        if {linger}:  # a child in the group that outlives the worker (vLLM's engine process)
            import subprocess
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        if {slow}:
            time.sleep(60)
    def generate(self, prompts, max_tokens):
        print("a log line of the peer", flush=True)
        return [max_tokens - (len(prompts[0]) == {short_at})] * len(prompts)
    def describe(self):
        return {{"kind": "instant"}}

sys.exit(main(Instant))
"""


def _fake(tmp_path: Path, slow: bool = False, short_at: int = -1, linger: bool = False) -> Any:
    script = tmp_path / "fake_peer.py"
    script.write_text(textwrap.dedent(FAKE_PEER.format(peers=str(BENCH / "peers"), slow=slow,
                                                       short_at=short_at, linger=linger)))
    return ep.PeerSpec("instant", str(script), Path(sys.executable), "M")


def test_worker_speaks_the_serve_protocol(tmp_path: Path) -> None:
    w = wl.Workload(**SMALL)
    worker = ep.Worker(_fake(tmp_path), w, tmp_path / "logs" / "instant.log", timeout_s=60)
    try:
        assert worker.start() == {"kind": "instant"}
        assert worker.sample("prefill", 16, "p16R0r0") > 0
        assert isinstance(worker.sample("decode", 4, "d4R0r0"), float)
        assert worker.cpu_seconds() > 0  # its interpreter's start-up at least
        with pytest.raises(ep.PeerFailed, match="error at train 3: WorkloadError: cell kind"):
            worker.sample("train", 3, "x")
    finally:
        worker.stop()
    assert worker.proc is not None and worker.proc.poll() is not None
    assert "a log line of the peer" in (tmp_path / "logs" / "instant.log").read_text()


def test_worker_reports_a_failed_call_missing_install_and_a_crash(tmp_path: Path) -> None:
    w = wl.Workload(**SMALL)
    worker = ep.Worker(_fake(tmp_path, short_at=32), w, tmp_path / "i.log", timeout_s=60)
    try:
        worker.start()
        with pytest.raises(ep.PeerFailed, match=r"asked for 1 tokens x 1 prompts, got \[0\]"):
            worker.sample("prefill", 32, "p")
    finally:
        worker.stop()
    missing = ep.PeerSpec("vllm-cpu", "run_vllm.py", tmp_path / "nope" / "python", "m")
    with pytest.raises(ep.PeerFailed) as err:
        ep.Worker(missing, w, tmp_path / "a.log").start()
    assert str(err.value) == (f"{tmp_path / 'nope' / 'python'} missing: run bash "
                              "benchmarks/peers/install_vllm_cpu.sh")
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('it broke')\nsys.exit(3)\n")
    worker = ep.Worker(ep.PeerSpec("yuebing", str(crash), Path(sys.executable), "m"), w,
                       tmp_path / "b.log")
    with pytest.raises(ep.PeerFailed) as err:
        worker.start()
    worker.stop()
    assert str(err.value) == f"exit status 3 at start-up; log {tmp_path / 'b.log'}: it broke"


def test_stop_waits_out_the_grace_then_kills_what_is_left_of_the_group(tmp_path: Path) -> None:
    """The worker quits at once; its child still runs: stop waits ``grace_s`` for it, then
    SIGKILLs the group, and no process of the group runs after (a zombie left to be reaped
    by init does not count)."""
    worker = ep.Worker(_fake(tmp_path, linger=True), wl.Workload(**SMALL), tmp_path / "l.log",
                       timeout_s=60)
    worker.start()
    assert worker.proc is not None
    pgid = worker.proc.pid
    assert len(group_pids(pgid)) == 2
    t0 = time.monotonic()
    worker.stop(grace_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 15
    assert worker.proc.returncode == 0  # it quit when asked; the child was killed
    assert not group_alive(pgid)


def test_stop_of_a_worker_whose_group_ends_returns_without_the_grace(tmp_path: Path) -> None:
    worker = ep.Worker(_fake(tmp_path), wl.Workload(**SMALL), tmp_path / "q.log", timeout_s=60)
    worker.start()
    t0 = time.monotonic()
    worker.stop(grace_s=30.0)
    assert time.monotonic() - t0 < 15 and worker.proc is not None
    assert worker.proc.returncode == 0 and not group_alive(worker.proc.pid)


def test_worker_is_killed_past_its_timeout(tmp_path: Path) -> None:
    worker = ep.Worker(_fake(tmp_path, slow=True), wl.Workload(**SMALL), tmp_path / "s.log",
                       timeout_s=1.0)
    t0 = time.perf_counter()
    with pytest.raises(ep.PeerFailed) as err:
        worker.start()
    worker.stop()
    assert time.perf_counter() - t0 < 30
    assert str(err.value) == f"timed out after 1 s at start-up (log {tmp_path / 's.log'})"


def test_serve_answers_commands_and_stops_at_quit() -> None:
    import io

    class Fixed(wl.Backend):  # type: ignore[name-defined]
        name = "fixed"

        def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
            return [max_tokens] * len(prompts)

    replies = io.StringIO()
    commands = io.StringIO('{"kind": "prefill", "size": 8, "tag": "a"}\nquit\n'
                           '{"kind": "prefill", "size": 8, "tag": "b"}\n')
    assert wl.serve(Fixed(), wl.Workload(**SMALL), commands, replies) == 0
    lines = replies.getvalue().splitlines()
    assert lines[0] == "READY {}" and len(lines) == 2 and lines[1].startswith("SAMPLE ")
    assert set(json.loads(lines[1].split(" ", 1)[1])) == {"value", "seconds"}
    bad = io.StringIO()
    assert wl.serve(Fixed(), wl.Workload(**SMALL), io.StringIO("{not json\n"), bad) == 1
    assert bad.getvalue().splitlines()[1].startswith("ERROR JSONDecodeError: ")


def test_tables_show_n_a_where_noise_swamped_the_decode_difference(tmp_path: Path) -> None:
    w = wl.Workload(batches=(1, 8), prefill_lens=(512,))
    merged = {"yuebing": ep.merge_runs([_result({"1": [10.0], "8": [40.0]}, {"512": [900.0]})]),
              "vllm-cpu": ep.merge_runs([_result({"1": [10.0], "8": [-5.0]}, {"512": [900.0]})])}
    assert merged["vllm-cpu"]["decode"]["8"]["tokens_per_s"] is None
    s = ep.summarize(merged, w)
    assert s["targets"][0] == {"target": "decode tok/s at batch 8 >= 1x vLLM-CPU (issue 5)",
                               "ratio": None, "basis": "pooled", "met": None}
    assert "| decode b=8 tok/s | 200.0 | n/a | - | - |" in ep.markdown(merged, s, w).splitlines()
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
    with pytest.raises(SystemExit):
        ep.parse_args(["--settle-s", "-1"])
    assert ("--settle-s, --idle-cap-s and --peer-timeout must be >= 0, got -1.0, 3.0, 0"
            in capsys.readouterr().err)
