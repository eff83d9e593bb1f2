"""Benchmark: overload on the live cluster (issue 26), each admission policy beside the simulator.

Per topology: the rate at which admission ``none`` keeps >= 90 % within the SLOs (a search),
a warm-up of what the Conductor learns, then a fresh ``yuebing serve`` per multiplier of that
rate, policy and seed under ``yuebing bench serve``, and the simulator on the same requests
and the instances' start-up profiles (``--sim-only``: it alone; ``--resim DIR``: a finished
run's simulator columns again). Writes ``OUTDIR/overload_live.json``, ``overload_live.md`` and
plots. Run by hand: commands and latest results in docs/benchmarks.md "Overload, live", the
method step by step in docs/reproduction.md "Overload, live"; tests/benchmarks/
test_overload_live.py checks its parts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from yuebing.bench.config import BenchConfig
from yuebing.bench.workload import scaled_request, send_times
from yuebing.conductor.calibration import DURATION_QUANTILES, MIN_OBSERVED_S
from yuebing.conductor.policy import Predictors
from yuebing.conductor.policy.admission import ADMISSIONS
from yuebing.conductor.policy.decode import duration_quantiles
from yuebing.conductor.policy.queue import DEFAULT_QUEUE, PREFILL_QUEUES
from yuebing.conductor.stats import parse_log_line
from yuebing.core.host import cpu_name, speed
from yuebing.ops.procs import ReadyProcess
from yuebing.sim.metrics import learned_tail as simulated_tail
from yuebing.sim.paper.overload import oscillation
from yuebing.sim.runner import SimResult, simulate
from yuebing.sim.system import SimConfig, sim_policy
from yuebing.sim.workload import SimRequest
from yuebing.trace.io import load_trace
from yuebing.trace.latency import nearest_rank

ROOT = Path(__file__).resolve().parent.parent
YB = str(ROOT / ".venv" / "bin" / "yuebing")
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
POLICIES = ("none", "early_rejection", "predictive_early_rejection")
TARGET = 0.9
RESERVE_REASONS = {"decode_kv_full", "instance_overloaded"}
console = Console(stderr=True)


@dataclass(frozen=True)
class Setup:
    """What every run of one invocation shares."""

    out: Path
    requests: int
    seed: int
    max_input: int
    max_output: int
    ttft_slo_s: float
    tbt_slo_s: float
    sample_s: float
    timeout_s: float
    port: int
    serve_flags: tuple[str, ...] = ()
    prefill_queue: str = DEFAULT_QUEUE
    """The prefill queue order of every cluster, live (``--prefill-queue``) and simulated."""
    learned_from: tuple[tuple[str, Path], ...] = ()
    """Per decode selector, the learned-state directory (``--learned-dir``) its clusters start
    from a copy of."""

    def bench_args(self) -> list[str]:
        return [str(TRACE), "--block-tokens", "64", "--max-input", str(self.max_input),
                "--max-output", str(self.max_output), "--limit", str(self.requests),
                "--seed", str(self.seed), "--slo-ttft", f"{self.ttft_slo_s:g}",
                "--slo-tbt", f"{self.tbt_slo_s:g}", "--timeout-s", f"{self.timeout_s:g}",
                "--no-progress", "--json"]


def parse_topology(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)P(\d+)D", text.strip())
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"topology {text!r} is not like 1P1D or 2P1D")
    return int(m[1]), int(m[2])


def positive_floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a comma-separated list of numbers") from None
    if not vals or any(not (math.isfinite(v) and v > 0) for v in vals):
        raise ValueError(f"{what}: every value must be a positive number, got {text!r}")
    return vals


# ---------------------------------------------------------------------------- a live cluster


def selector_of(policy: str) -> str:
    """The decode selector ``policy`` runs with (the predictive one routes by its forecast)."""
    return "forecast" if policy == "predictive_early_rejection" else "least_loaded"


class Cluster:
    """One ``yuebing serve`` (``prefill`` + ``decode`` instances, one thread each) on ``port``,
    its logs under ``logs``; a context manager that stops it (SIGINT, then SIGKILL)."""

    def __init__(self, setup: Setup, nodes: tuple[int, int], policy: str, logs: Path,
                 selector: str = "") -> None:
        self.url = f"http://127.0.0.1:{setup.port}"
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.selector = selector or selector_of(policy)
        self.learned = logs / "learned"
        """This Conductor's learned state: a copy of its selector's ``setup.learned_from``."""
        shutil.rmtree(self.learned, ignore_errors=True)
        source = dict(setup.learned_from).get(self.selector)
        if source is not None and source.is_dir():
            shutil.copytree(source, self.learned)
        self.learned.mkdir(exist_ok=True)
        self.argv = [YB, "-v", "serve", "--prefill", str(nodes[0]), "--decode", str(nodes[1]),
                     "--threads", "1", "--port", str(setup.port), "--log-dir", str(logs),
                     "--restart", "never", "--admission", policy, "--decode-selector", self.selector,
                     "--ttft-slo-s", f"{setup.ttft_slo_s:g}",
                     "--tbt-slo-s", f"{setup.tbt_slo_s:g}",
                     "--learned-dir", str(self.learned), "--prefill-queue", setup.prefill_queue,
                     *setup.serve_flags]
        self.proc: ReadyProcess | None = None

    def __enter__(self) -> Cluster:
        """Start it and wait for its ready file (every role ready; output in ``serve.log``)."""
        self.proc = ReadyProcess(self.argv, name="serve", workdir=self.logs, timeout_s=900,
                                 stop_s=60)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.stop()

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as r:
            return bytes(r.read())


class LoadSampler(threading.Thread):
    """Polls the Conductor's ``/health`` pools every ``period_s`` until `stop`."""

    def __init__(self, cluster: Cluster, period_s: float) -> None:
        super().__init__(daemon=True)
        self.cluster, self.period_s = cluster, period_s
        self.samples: list[dict[str, float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._halt.wait(self.period_s):
            try:
                pools = json.loads(self.cluster.get("/health"))["pools"]
            except (OSError, ValueError, KeyError):
                continue
            self.samples.append({"t": time.monotonic() - t0, **pools})

    def stop(self) -> list[dict[str, float]]:
        self._halt.set()
        self.join()
        return self.samples


def rejected_by_reason(metrics_text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in re.finditer(r'^yuebing:rejected_requests_total\{reason="([^"]+)"\} (\S+)$',
                         metrics_text, re.M):
        out[m[1]] = int(float(m[2]))
    return out


def stage_of(reason: str) -> str:
    if reason in RESERVE_REASONS:
        return "reserve"
    return "limit" if reason == "too_many_requests" else "arrival"


def wasted_prefill(log: Path, ttft_slo_s: float, tbt_slo_s: float) -> dict[str, int]:
    """Prompt tokens prefilled (prompt - cached, for requests whose prefill ran) in all, and
    for requests then cut off (not 200) or served outside an SLO, from the access log."""
    total = wasted = 0
    text = log.read_text(errors="replace") if log.exists() else ""
    for f in filter(None, map(parse_log_line, text.splitlines())):
        status, tokens = f["status"], max(0, int(f["prompt"]) - int(f["cached"]))
        if float(f["prefill"]) <= 0 and status != 200:
            continue  # never reached its prefill
        total += tokens
        if status != 200 or float(f["ttft"]) > ttft_slo_s or float(f["tbt"]) > tbt_slo_s:
            wasted += tokens
    return {"prefilled_tokens": total, "wasted_tokens": wasted}


def prefill_slowdown(log: Path, predictors: Path) -> float:
    """How much slower a cluster's prefills ran than ``predictors`` (its start-up profiles,
    the engine alone) predict: the median of live over predicted prefill time in the access log
    ``log`` (a rate search's), over the answered requests predicted at least `MIN_OBSERVED_S`
    whose prefill overlapped no other prefill instance's (those take turns on a core, which the
    simulator models itself); at least 1, and 1 when none qualifies. The simulator's slowdown
    of two engines computing at once (`interference_file`): live, the decode engine steps
    beside them all along."""
    predict = Predictors.from_json(predictors.read_bytes(), str(predictors)).prefill.predict
    text = log.read_text(errors="replace") if log.exists() else ""
    rows = []
    for line in text.splitlines():
        f = parse_log_line(line)
        if f is None or f["status"] != 200 or "e2e" not in f:
            continue
        # logged at the request's end: the line's time
        end = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        start = end - float(f["e2e"]) + float(f["queue"]) + float(f["prefix_load"])
        prefill, cached = float(f["prefill"]), int(f["cached"])
        rows.append((str(f["prefill_id"]), start, start + prefill, prefill,
                     predict(max(0, int(f["prompt"]) - cached), cached)))
    ratios = [live / est for node, lo, hi, live, est in rows if est >= MIN_OBSERVED_S
              and not any(n != node and a < hi and lo < b for n, a, b, _, _ in rows)]
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


def pct(values: list[float], q: float) -> float | None:
    """`nearest_rank`, None (JSON null) for no values."""
    v = nearest_rank(values, q)
    return None if math.isnan(v) else v


def latency(ttft: list[float], tbt: list[float]) -> dict[str, float | None]:
    return {"ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9), "ttft_p99": pct(ttft, 0.99),
            "tbt_p50": pct(tbt, 0.5), "tbt_p90": pct(tbt, 0.9), "tbt_p99": pct(tbt, 0.99)}


def load_stats(samples: list[dict[str, float]], period_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pool in ("prefill", "decode"):
        series = [s[pool] for s in samples]
        osc = oscillation(series, period_s)
        out[pool] = {"mean": sum(series) / len(series) if series else 0.0,
                     "std": osc["std"], "swing": osc["swing"]}
    return out


def live_run(setup: Setup, nodes: tuple[int, int], policy: str, rate: float,
             name: str, retry: bool = False, selector: str = "") -> dict[str, Any]:
    """One fresh cluster under ``policy`` at ``rate`` (``retry``: clients resend a 429 after
    its Retry-After; ``selector``: another decode selector than the policy's): the run's
    figures (see module doc)."""
    logs = setup.out / "logs" / name
    records = setup.out / f"{name}.records.jsonl"
    host = speed().as_dict()  # the host's phase for this run (it moves within minutes)
    with Cluster(setup, nodes, policy, logs, selector) as cluster:
        start_tail = learned_tail(cluster)
        sampler = LoadSampler(cluster, setup.sample_s)
        sampler.start()
        argv = [YB, "bench", "serve", *setup.bench_args(), "--endpoint", cluster.url,
                "--rate", f"{rate:g}", "--records", str(records)]
        if retry:
            argv.append("--retry-429")
        bench = subprocess.run(argv, capture_output=True)
        samples = sampler.stop()
        reasons = rejected_by_reason(cluster.get("/metrics").decode())
        tail = learned_tail(cluster)
    if bench.returncode != 0:
        raise RuntimeError(f"yuebing bench serve failed ({bench.returncode}): "
                           f"{bench.stderr.decode(errors='replace')[-1000:]}")
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    return {**summarize_live(setup, rows, reasons, samples,
                             wasted_prefill(logs / "conductor.log", setup.ttft_slo_s,
                                            setup.tbt_slo_s), retry), "tbt_tail": tail,
            "tbt_tail_start": start_tail, "host_speed": host, "first_ttft_s": first_ttft(rows)}


def first_ttft(rows: list[dict[str, Any]]) -> float | None:
    """The TTFT of the workload's first request, alone on the fresh cluster: the cluster's
    speed at its start, beside the host's (policies are compared across clusters)."""
    first = [r for r in rows if r.get("index") == 0 and r.get("status") == "ok"]
    return float(first[0]["ttft_s"]) if first and first[0].get("ttft_s") is not None else None


def learned_tail(cluster: Cluster) -> float:
    """The TBT tail the Conductor's policy learned (``/health``), 1.0 if it reports none."""
    return float(json.loads(cluster.get("/health")).get("tbt_tail", {}).get("tail", 1.0))


def step_tail_of(topo: dict[str, Any]) -> float:
    """The simulated decode steps' tail for a topology's runs: the mean of what its warm-ups
    learned (admission ``none`` at the middle load, on a seed no measured run uses; a warm-up
    still at 1.0, the Conductor's start, learned nothing), else its rate search's. The tail
    depends on the load (a paper TBT over a step that grows with the batch), and a search runs
    at half the 2x runs' load."""
    tails = [w["tbt_tail"] for w in topo.get("warmup", {}).values()
             if w.get("tbt_tail") and w["tbt_tail"] != 1.0]
    return sum(tails) / len(tails) if tails else float(topo.get("tbt_tail") or 1.0)


def summarize_live(setup: Setup, rows: list[dict[str, Any]], reasons: dict[str, int],
                   samples: list[dict[str, float]], waste: dict[str, int],
                   retry: bool = False) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == "ok"]
    good = [r for r in ok if r["ttft_s"] <= setup.ttft_slo_s
            and (r["tbt_s"] is None or r["tbt_s"] <= setup.tbt_slo_s)]
    ends = [r["end_s"] for r in rows if r["end_s"] is not None]
    starts = [r["scheduled_s"] for r in rows]
    span = (max(ends) - min(starts)) if ends and starts else 0.0
    stages: dict[str, int] = {}
    for reason, n in reasons.items():
        stages[stage_of(reason)] = stages.get(stage_of(reason), 0) + n
    retried = [r for r in rows if r.get("retries", 0) > 0]
    errors: dict[str, int] = {}
    for r in rows:
        if r["status"] == "error":
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    out: dict[str, Any] = {
        "requests": len(rows), "answered": len(ok), "within_slo": len(good),
        "rejected": sum(1 for r in rows if r["status"] == "rejected"), "errors": errors,
        "goodput_rps": len(good) / span if span > 0 else 0.0, "span_s": span,
        "rejections_by_reason": reasons, "rejections_by_stage": stages, **waste,
        "latency": latency([r["ttft_s"] for r in ok], [r["tbt_s"] for r in ok]),
        "load": load_stats(samples, setup.sample_s), "samples": samples}
    if retry:
        out["retried"] = len(retried)
        out["retried_then_answered"] = sum(1 for r in retried if r["status"] == "ok")
        out["retried_then_within_slo"] = sum(1 for r in retried if r in good)
    if not ok:
        out["verdict"] = ("the cluster rejected every request" if out["rejected"] == len(rows)
                          else "the cluster answered no request")
    return out


def find_max_rate(setup: Setup, nodes: tuple[int, int], rates: list[float],
                  name: str) -> tuple[float | None, Path, float]:
    """The largest of ``rates`` with attainment >= 90 % under admission ``none``, the
    instances' start-up predictors (``OUTDIR/<name>.startup.predictors.json``, for the
    simulator) and the Conductor's TBT tail after the sweep (its predictors, scaled online,
    saved as ``OUTDIR/<name>.predictors.json``)."""
    logs = setup.out / "logs" / name
    path = setup.out / f"{name}.predictors.json"
    with Cluster(setup, nodes, "none", logs) as cluster:
        argv = [YB, "bench", "serve", *setup.bench_args(), "--endpoint", cluster.url,
                "--sweep-rates", ",".join(f"{r:g}" for r in rates), "--sweep-down",
                "--stop-when-decided", "--target-attainment", f"{TARGET:g}",
                "--records", str(setup.out / f"{name}.records.jsonl")]
        bench = subprocess.run(argv, capture_output=True)
        path.write_bytes(cluster.get("/predictors"))
        tail = learned_tail(cluster)
    if bench.returncode != 0:
        raise RuntimeError(f"yuebing bench serve failed ({bench.returncode}): "
                           f"{bench.stderr.decode(errors='replace')[-1000:]}")
    report = json.loads(bench.stdout)
    (setup.out / f"{name}.json").write_bytes(bench.stdout)
    rate = report.get("max_rate")
    try:
        startup = startup_predictors(logs, setup.out / f"{name}.startup.predictors.json")
    except ValueError as e:  # instances started without a profile: the scaled ones, said so
        console.print(f"[yellow]{name}: {e}; the simulator takes the Conductor's predictors "
                      "(their prefill scaled online)[/]")
        startup = path
    return (float(rate) if rate is not None else None), startup, tail


def startup_predictors(logs: Path, out: Path) -> Path:
    """A predictor file (``out``) fitted, as the Conductor fits them, to the start-up profiles
    in the ready files of the cluster logged in ``logs`` (``prefill-0`` and ``decode-0``): the
    engine alone at its one thread. The simulator's cost model: the Conductor's own predictors
    carry an online prefill scale (an average of the latest prefills, 0.6x-3x on these runs),
    which mixes the host's load of that moment into every simulated prefill."""
    import msgspec

    from yuebing.conductor.calibration import DECODE, PREFILL, fit_profile
    from yuebing.conductor.policy import Predictors, TransferPredictor
    from yuebing.protocol.instance import EngineProfile

    fits: dict[str, Any] = {}
    for part, role in ((PREFILL, "prefill-0"), (DECODE, "decode-0")):
        ready = logs / f"{role}.ready.json"
        try:
            profile = msgspec.convert(json.loads(ready.read_text())["profile"], EngineProfile)
        except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as e:
            raise ValueError(f"{ready}: no start-up profile to fit ({e})") from None
        fits[part] = (fit_profile(profile, part), dict(profile.configuration))
    pred = Predictors(fits[PREFILL][0], fits[DECODE][0], TransferPredictor(),
                      source=f"start-up profiles in {logs}", configuration=fits[PREFILL][1])
    out.write_text(pred.to_json())
    return out


def sim_predictors(path: Path, out: Path) -> Path:
    """``--predictors``: a predictor file as is, or a cluster's log directory whose start-up
    profiles are fitted (`startup_predictors`, written to ``out``)."""
    return startup_predictors(path, out) if path.is_dir() else path


def host_cores(predictors: Path) -> int:
    """The cores of the machine the predictors were profiled on (their configuration's
    ``machine``: ``... | 2 cores``), else this machine's."""
    machine = Predictors.from_json(predictors.read_bytes(), str(predictors)).configuration.get(
        "machine", "")
    m = re.search(r"(\d+) cores", machine)
    return int(m[1]) if m else (os.cpu_count() or 1)


# ---------------------------------------------------------------------------- the simulator


def sim_requests(setup: Setup, rate: float) -> list[SimRequest]:
    """The requests ``yuebing bench serve`` sends at ``rate`` (same lengths, hash blocks and
    arrival times: `scaled_request` and `send_times`, the functions the load generator uses)."""
    trace = load_trace(TRACE)
    cfg = BenchConfig(block_tokens=64, max_input=setup.max_input, max_output=setup.max_output,
                      limit=setup.requests, rate=rate, seed=setup.seed)
    reqs = [scaled_request(r, trace.block_size, cfg)
            for r in trace.in_time_order()[:setup.requests]]
    return [SimRequest(i, t, r.input_length, r.output_length, tuple(r.hash_ids))
            for i, (r, t) in enumerate(zip(reqs, send_times(reqs, cfg, rate), strict=True))]


def interference_file(setup: Setup, factor: float) -> Path:
    """The colocation factors the simulator runs with (``OUTDIR/interference.json``): a decode
    step beside a prefill and a prefill beside a decode step each take ``factor`` (the rate
    search's `prefill_slowdown` or ``--sim-stretch``; 1: none) on top of the cores' sharing."""
    path = setup.out / "interference.json"
    path.write_text(json.dumps({"interference": {"decode_factor": max(factor, 1.0),
                                                 "prefill_factor": max(factor, 1.0)}}))
    return path


def simulated(setup: Setup, nodes: tuple[int, int], policy: str, rate: float,
              predictors: Path, tail: float, stretch: float,
              durations: tuple[float, ...] = (), step_tail: float = 1.0) -> SimResult:
    """The simulator on the bench requests, every node on one host of the predictors'
    machine's cores (`host_cores`): the policy predicts with ``tail`` and forecasts with decode
    ``durations`` (empty: the simulator's own); a decode step beside a prefill and a prefill
    beside a decode step take ``stretch`` on top of the cores' sharing (`interference_file`);
    a tenth of the decode steps, drawn from ``setup.seed``, are slow, so that with the stretch
    a request's paper TBT is ``step_tail`` times its step (`SimConfig.decode_tail`)."""
    selector = "forecast" if policy == "predictive_early_rejection" else "least_loaded"
    cfg = SimConfig(system="mooncake", prefill_nodes=nodes[0], decode_nodes=nodes[1],
                    policy=sim_policy(admission=policy, decode_selector=selector,
                                      block_tokens=64, ttft_slo_s=setup.ttft_slo_s,
                                      tbt_slo_s=setup.tbt_slo_s, cpp_threshold_tokens=1 << 30,
                                      tbt_tail=tail, seed=setup.seed,
                                      prefill_queue=setup.prefill_queue),
                    cost_model="fitted", profile=str(predictors),
                    sample_interval_s=setup.sample_s, colocated=True,
                    host_cores=host_cores(predictors),
                    interference_profile=str(interference_file(setup, stretch)),
                    forecast_durations_s=durations, decode_tail=step_tail)
    return simulate(sim_requests(setup, rate), cfg)


def warm_durations(setup: Setup, nodes: tuple[int, int], rate: float, predictors: Path,
                   tail: float, stretch: float, step_tail: float = 1.0) -> tuple[float, ...]:
    """The decode durations a live Conductor's warm-up teaches it (``--learned warm``), here
    from a simulated ``none`` run on ``setup``'s seed: `duration_quantiles` of its requests'
    first token to last, as `yuebing.conductor.calibration.DecodeDurations` learns them
    (empty when no request finished)."""
    res = simulated(setup, nodes, "none", rate, predictors, tail, stretch, step_tail=step_tail)
    seconds = [r.finish_s - r.first_token_s for r in res.records
               if r.rejected is None and r.finish_s > r.first_token_s]
    return duration_quantiles(seconds, min(DURATION_QUANTILES, len(seconds))) if seconds else ()


def sim_run(setup: Setup, nodes: tuple[int, int], policy: str, rate: float,
            predictors: Path, tail: float = 1.0, stretch: float = 1.0,
            durations: tuple[float, ...] = (), step_tail: float = 1.0) -> dict[str, Any]:
    """One simulated run (`simulated`), summarized as a live run is (its ``tbt_tail``: the
    one a live Conductor would learn from it, `yuebing.sim.metrics.learned_tail`)."""
    res = simulated(setup, nodes, policy, rate, predictors, tail, stretch, durations, step_tail)
    recs = res.records
    done = [r for r in recs if r.rejected is None and not math.isnan(r.finish_s)]
    good = [r for r in done if r.ttft_s <= setup.ttft_slo_s and r.tbt_s <= setup.tbt_slo_s]
    ends = [r.finish_s for r in done] + [r.arrival_s for r in recs if r.rejected is not None]
    span = max(ends) - min(r.arrival_s for r in recs) if ends else 0.0
    wasted = sum(max(0, r.input_tokens - r.hit_tokens) for r in done if r not in good)
    series = {"prefill": res.timeseries["prefill_load"],
              "decode": res.timeseries["decode_tbt_load"]}
    samples = [{"t": i * setup.sample_s, "prefill": p, "decode": d}
               for i, (p, d) in enumerate(zip(series["prefill"], series["decode"], strict=True))]
    return {"requests": len(recs), "answered": len(done), "within_slo": len(good),
            "rejected": sum(1 for r in recs if r.rejected is not None),
            "goodput_rps": len(good) / span if span > 0 else 0.0, "span_s": span,
            "wasted_tokens": wasted, "tbt_tail": simulated_tail(recs),
            "latency": latency([r.ttft_s for r in done], [r.tbt_s for r in done]),
            "load": load_stats(samples, setup.sample_s), "samples": samples}


def none_tail(topo: dict[str, Any], run: dict[str, Any]) -> float:
    """The TBT tail ``run``'s simulated policy predicts with: the one its seed's live ``none``
    run learned at its load (the tail that load makes, unmoved by admission), else the rate
    search's (``topo["tbt_tail"]``: a run whose ``--policies`` left ``none`` out)."""
    return next((r["live"]["tbt_tail"] for r in topo["runs"] if r["policy"] == "none"
                 and r["seed"] == run["seed"] and r["multiplier"] == run["multiplier"]),
                topo["tbt_tail"])


@dataclass
class SimColumn:
    """The simulator's column of one topology's live runs, filled as the benchmark runs them
    and again by ``--resim``: each run on its own seed's requests at its rate with
    `none_tail`; ``warm``: the forecast's decode durations those of a simulated warm-up (at
    ``warm_rate`` on ``warm_seed``, `warm_durations`), one per tail, kept here."""
    setup: Setup
    nodes: tuple[int, int]
    predictors: Path
    stretch: float
    step_tail: float
    warm: bool
    warm_rate: float
    warm_seed: int
    durations: dict[float, tuple[float, ...]] = field(default_factory=dict)

    def fill(self, topo: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        """Set ``run["sim"]`` for each of ``runs`` (runs of ``topo``)."""
        for run in runs:
            tail = none_tail(topo, run)
            if self.warm and tail not in self.durations:
                self.durations[tail] = warm_durations(
                    replace(self.setup, seed=self.warm_seed), self.nodes, self.warm_rate,
                    self.predictors, tail, self.stretch, self.step_tail)
            run["sim"] = sim_run(replace(self.setup, seed=run["seed"]), self.nodes,
                                 run["policy"], run["rate"], self.predictors, tail,
                                 self.stretch, self.durations.get(tail, ()), self.step_tail)


# ---------------------------------------------------------------------------- report


def table(result: dict[str, Any]) -> str:
    lines = ["| cluster | load | policy | goodput live / sim (req/s) | within SLO | rejected "
             "(arrival / reserve) | prefill thrown away (tokens) | TTFT p50 / p99 (s) | "
             "TBT p99 (ms) | TBT tail live / sim | prefill load std / swing | decode load std / "
             "swing | first TTFT (s) / host copy GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for topo in result["topologies"]:
        for run in topo["runs"]:
            live, sim = run["live"], run["sim"]
            lat = live["latency"]
            st = live["rejections_by_stage"]

            def f(v: float | None, k: float = 1.0, d: int = 2) -> str:
                return "–" if v is None else f"{v * k:.{d}f}"

            lines.append(
                f"| {topo['name']} | {run['multiplier']:g}× ({run['rate']:.3g} req/s)"
                f"{' seed ' + str(run['seed']) if 'seed' in run else ''} | "
                f"{run['policy']} | {live['goodput_rps']:.3f} / {sim['goodput_rps']:.3f} | "
                f"{live['within_slo']}/{live['requests']} | {live['rejected']} "
                f"({st.get('arrival', 0)} / {st.get('reserve', 0)}) | "
                f"{live['wasted_tokens']:,} of {live['prefilled_tokens']:,} | "
                f"{f(lat['ttft_p50'])} / {f(lat['ttft_p99'])} | {f(lat['tbt_p99'], 1e3, 0)} | "
                f"{f(live.get('tbt_tail'))} / {f(sim.get('tbt_tail'))} | "
                f"{live['load']['prefill']['std']:.2f} / {live['load']['prefill']['swing']:.2f}"
                f" | {live['load']['decode']['std']:.2f} / {live['load']['decode']['swing']:.2f}"
                f" | {f(live.get('first_ttft_s'))} / "
                f"{f(live.get('host_speed', {}).get('copy_gbps'), d=1)} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [t for t in result["topologies"] if t["runs"]]
    for topo in measured:
        runs = topo["runs"]
        mults = sorted({r["multiplier"] for r in runs})
        mid = mults[len(mults) // 2]
        shown = [r for r in runs if r["multiplier"] == mid and not r.get("repeat")]
        fig, axes = plt.subplots(len(shown), 1, figsize=(8, 2.4 * len(shown)), sharex=True,
                                 squeeze=False)
        for ax, run in zip(axes[:, 0], shown, strict=True):
            s = run["live"]["samples"]
            ax.plot([x["t"] for x in s], [x["prefill"] for x in s], label="prefill load")
            ax.plot([x["t"] for x in s], [x["decode"] for x in s], label="decode load")
            ax.axhline(1.0, color="grey", lw=0.6, ls="--")
            ax.set(title=f"{topo['name']} at {mid:g}×: {run['policy']}", ylabel="load")
            ax.legend(loc="upper right", fontsize=7)
        axes[-1, 0].set_xlabel("seconds")
        fig.tight_layout()
        fig.savefig(out / f"overload_load_{topo['name']}.png", dpi=120)
        plt.close(fig)
    fig, axes = plt.subplots(1, len(measured), figsize=(5 * len(measured), 3.6), squeeze=False)
    for ax, topo in zip(axes[0], measured, strict=True):
        # a run's own order of policies; the runs' where a result does not name it
        for policy in topo.get("policies") or dict.fromkeys(r["policy"] for r in topo["runs"]):
            xs = sorted({r["multiplier"] for r in topo["runs"] if r["policy"] == policy})
            runs = [mean_runs([r for r in topo["runs"] if r["multiplier"] == x])[policy]
                    for x in xs]
            line, = ax.plot(xs, [r["live"]["goodput_rps"] for r in runs], "o-", label=policy)
            ax.plot(xs, [r["sim"]["goodput_rps"] for r in runs], "x--", color=line.get_color())
        ax.set(title=f"{topo['name']} (max rate {topo['max_rate']:.3g} req/s; × = sim)",
               xlabel="load (× max rate)", ylabel="goodput (req/s within SLO)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "overload_goodput.png", dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--topologies", default="1P1D,2P1D")
    p.add_argument("--multipliers", default="1.5,2,3")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="admission policies, each on fresh clusters (offered: "
                        + ", ".join(ADMISSIONS.names()) + ")")
    p.add_argument("--base-rate", default="",
                   help="the maximum rate per topology (comma-separated, one per topology): "
                        "skips the search")
    p.add_argument("--find-rates", default="0.2,0.3,0.4,0.5,0.6,0.8",
                   help="rates the maximum rate is searched among (req/s)")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per load and policy, seeds --seed, --seed+1, ... (the policies "
                        "interleaved per seed, their order rotated from seed to seed; the "
                        "checks compare their means)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input", type=int, default=2048)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--ttft-slo-s", type=float, default=10.0)
    p.add_argument("--tbt-slo-s", type=float, default=0.1)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--retry-policy", default="predictive_early_rejection",
                   help="one more run per topology at the middle multiplier under this policy, "
                        "its clients resending each 429 after its Retry-After ('' : none)")
    p.add_argument("--port", type=int, default=8767)
    p.add_argument("--serve-flags", default="", help="extra `yuebing serve` flags")
    p.add_argument("--learned", choices=("warm", "cold"), default="warm",
                   help="warm: every measured cluster starts from what one warm-up run (none, "
                        "the middle multiplier, another seed) learned online; cold: each "
                        "learns from nothing")
    p.add_argument("--prefill-queue", default=DEFAULT_QUEUE, choices=PREFILL_QUEUES.names(),
                   help="the prefill queue order of every cluster, live and simulated "
                        "(default: the live Conductor's)")
    p.add_argument("--no-sim", action="store_true")
    p.add_argument("--resim", type=Path, default=None,
                   help="no cluster: a finished live run's OUTDIR, its simulator columns run "
                        "again on its workload (its setup), the start-up profiles of its "
                        "<cluster>-max logs (or --predictors) and each seed's none tail; writes "
                        "OUTDIR/overload_live.json and .md with the checks")
    p.add_argument("--sim-only", action="store_true",
                   help="no cluster: the simulator alone at --base-rate x --multipliers over "
                        "--repeats seeds, on --predictors with --tbt-tail (means, min-max, "
                        "paired bootstrap interval against none); writes OUTDIR/overload_sim.*")
    p.add_argument("--predictors", default="",
                   help="the simulator's cost model, one for all topologies or one per topology "
                        "(comma-separated): a predictor file (a live run's <cluster>-max.startup."
                        "predictors.json) or a cluster's log directory (its start-up profiles "
                        "are fitted); needed by --sim-only, used with --base-rate (which skips "
                        "the search that saves one)")
    p.add_argument("--tbt-tail", type=float, default=2.27,
                   help="--sim-only: the TBT tail the policy predicts with and, unless "
                        "--sim-step-tail, the decode steps' (a live rate search's learned tail)")
    p.add_argument("--sim-durations", choices=("warm", "cost"), default="warm",
                   help="the decode durations the simulated forecast assumes: warm (the "
                        "default) those a simulated none run at the middle multiplier on a "
                        "seed no measured run uses realizes, as the live warm-up teaches the "
                        "Conductor; cost: the workload's outputs times a loaded node's step, "
                        "capped at the TBT SLO")
    p.add_argument("--sim-step-tail", type=float, default=None,
                   help="the simulated decode steps' tail (`SimConfig.decode_tail`: a tenth of "
                        "the steps this many times slower, so a request's paper TBT carries the "
                        "live steps' jitter); default: the mean tail the live warm-ups learned "
                        "(without warm-ups the rate search's, 1 with --base-rate; --resim: the "
                        "run's; --sim-only: --tbt-tail); 1: even steps")
    p.add_argument("--sim-stretch", type=float, default=0.0,
                   help="the slowdown (>= 1) of a simulated decode step beside a prefill and "
                        "of a prefill beside a decode step, on top of the cores' sharing; 1 "
                        "adds none. 0 (the default) takes the rate search's `prefill_slowdown` "
                        "(its live prefills over the start-up profile's), or 1 when the run "
                        "has no rate search")
    ns = p.parse_args()
    try:
        topologies = [parse_topology(t) for t in ns.topologies.split(",")]
        mults = positive_floats(ns.multipliers, "--multipliers")
        find = positive_floats(ns.find_rates, "--find-rates")
        bases = positive_floats(ns.base_rate, "--base-rate") if ns.base_rate else []
        policies = [x.strip() for x in ns.policies.split(",") if x.strip()]
        unknown = [x for x in policies if x not in ADMISSIONS.names()]
        if unknown or not policies:
            raise ValueError(f"--policies: {', '.join(unknown) or 'none given'} not offered; "
                             f"use {', '.join(ADMISSIONS.names())}")
        if len(set(policies)) != len(policies):
            raise ValueError(f"--policies: {ns.policies} names a policy twice")
        if ns.retry_policy and ns.retry_policy not in ADMISSIONS.names():
            raise ValueError(f"--retry-policy: {ns.retry_policy} not offered; use "
                             f"{', '.join(ADMISSIONS.names())}")
        if bases and len(bases) != len(topologies):
            raise ValueError(f"--base-rate: {len(bases)} rates for {len(topologies)} topologies")
        for name in ("requests", "repeats", "max_input", "max_output"):
            if getattr(ns, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if ns.resim is not None and not (ns.resim / "overload_live.json").is_file():
            raise ValueError(f"--resim: no {ns.resim / 'overload_live.json'}")
        if ns.sim_only and not (bases and ns.predictors):
            raise ValueError("--sim-only needs --base-rate and --predictors")
        given = [Path(x.strip()) for x in ns.predictors.split(",") if x.strip()]
        if len(given) not in (0, 1, len(topologies)):
            raise ValueError(f"--predictors: {len(given)} paths for {len(topologies)} "
                             "topologies (give one, or one per topology)")
        missing = [str(x) for x in given if not x.exists()]
        if missing:
            raise ValueError(f"--predictors: no file or directory {', '.join(missing)}")
        if not (math.isfinite(ns.tbt_tail) and ns.tbt_tail >= 1.0):
            raise ValueError(f"--tbt-tail must be a number >= 1, got {ns.tbt_tail}")
        if ns.sim_step_tail is not None and not (math.isfinite(ns.sim_step_tail)
                                                 and ns.sim_step_tail >= 1.0):
            raise ValueError(f"--sim-step-tail must be a number >= 1, got {ns.sim_step_tail}")
        if not (math.isfinite(ns.sim_stretch) and (ns.sim_stretch == 0 or ns.sim_stretch >= 1)):
            raise ValueError(f"--sim-stretch must be 0 or a number >= 1, got {ns.sim_stretch}")
        for name in ("ttft_slo_s", "tbt_slo_s", "sample_s", "timeout_s"):
            if not (math.isfinite(getattr(ns, name)) and getattr(ns, name) > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number")
    except ValueError as e:
        print(f"overload_live: {e}", file=sys.stderr)
        return 2
    ns.outdir.mkdir(parents=True, exist_ok=True)
    setup = Setup(ns.outdir, ns.requests, ns.seed, ns.max_input, ns.max_output, ns.ttft_slo_s,
                  ns.tbt_slo_s, ns.sample_s, ns.timeout_s, ns.port,
                  tuple(ns.serve_flags.split()), ns.prefill_queue)
    try:
        chosen = [sim_predictors(given[min(i, len(given) - 1)],
                                 ns.outdir / f"{n[0]}P{n[1]}D.startup.predictors.json")
                  for i, n in enumerate(topologies)] if given else []
    except ValueError as e:
        print(f"overload_live: --predictors: {e}", file=sys.stderr)
        return 2
    if ns.resim is not None:
        return resim(ns.resim, ns.outdir, chosen, ns.sim_stretch,
                     ns.sim_durations == "warm", ns.sim_step_tail)
    if ns.sim_only:
        return sim_only(setup, topologies, bases, mults, policies, ns.repeats, chosen,
                        ns.tbt_tail, ns.sim_stretch or 1.0, ns.sim_durations == "warm",
                        ns.sim_step_tail or ns.tbt_tail)
    result: dict[str, Any] = {"setup": {k: str(v) if isinstance(v, Path) else v
                                        for k, v in vars(ns).items() if k != "outdir"},
                              "machine": machine(), "host_speed": {"start": speed().as_dict()},
                              "topologies": []}
    warm = sorted({selector_of(x) for x in [*policies, ns.retry_policy] if x}) \
        if ns.learned == "warm" else []
    total = len(topologies) * (len(mults) * len(policies) * ns.repeats + (0 if bases else 1)
                               + (1 if ns.retry_policy else 0) + len(warm))
    with Progress(console=console) as bar:
        task = bar.add_task("overload runs", total=total)
        for i, nodes in enumerate(topologies):
            name = f"{nodes[0]}P{nodes[1]}D"
            topo: dict[str, Any] = {"name": name, "policies": policies, "runs": []}
            result["topologies"].append(topo)  # written after each seed: a killed run keeps it
            if bases:
                base, predictors, tail = bases[i], (chosen[i] if chosen else None), 1.0
            else:
                bar.update(task, description=f"{name}: maximum rate")
                found, predictors, tail = find_max_rate(setup, nodes, find, f"{name}-max")
                bar.advance(task)
                if found is None:
                    topo["verdict"] = (f"no rate of {find} reached {TARGET:.0%} attainment; "
                                       "give lower --find-rates")
                    continue
                base = found
            topo["max_rate"] = base
            topo["predictors"] = str(predictors) if predictors else None
            topo["tbt_tail"] = tail
            stretch = topo["sim_stretch"] = ns.sim_stretch or (
                prefill_slowdown(ns.outdir / "logs" / f"{name}-max" / "conductor.log",
                                 predictors) if predictors and not bases else 1.0)
            setup = replace(setup, learned_from=())
            learned, topo["warmup"] = [], {}
            mid = sorted(mults)[len(mults) // 2]  # the middle load: warm-ups, retries
            for selector in warm:  # admission none, the middle load, a seed not measured
                bar.update(task, description=f"{name}: warm-up ({selector})")
                warmup = live_run(replace(setup, seed=setup.seed + ns.repeats), nodes, "none",
                                  base * mid, f"{name}-warmup-{selector}", selector=selector)
                topo["warmup"][selector] = {"rate": base * mid, "tbt_tail": warmup["tbt_tail"],
                                            "goodput_rps": warmup["goodput_rps"]}
                learned.append((selector, ns.outdir / "logs" / f"{name}-warmup-{selector}"
                                / "learned"))
                bar.advance(task)
            setup = replace(setup, learned_from=tuple(learned))
            step_tail = topo["sim_step_tail"] = ns.sim_step_tail or step_tail_of(topo)
            sims = SimColumn(setup, nodes, predictors, stretch, step_tail,
                             ns.sim_durations == "warm", base * mid,
                             setup.seed + ns.repeats) if predictors and not ns.no_sim else None
            for mult, r in ((m, r) for m in mults for r in range(ns.repeats)):
                rs = replace(setup, seed=setup.seed + r)
                lives: dict[str, dict[str, Any]] = {}
                for policy in rotated(policies, r):  # each policy takes each place in turn
                    run_name = f"{name}-x{mult:g}-{policy}" + (f"-r{r}" if r else "")
                    bar.update(task, description=run_name)
                    lives[policy] = live_run(rs, nodes, policy, base * mult, run_name)
                    lives[policy]["order"] = len(lives)
                    bar.advance(task)
                runs = [{"multiplier": mult, "rate": base * mult, "policy": policy, "repeat": r,
                         "seed": rs.seed, "live": lives[policy], "sim": {"goodput_rps": math.nan}}
                        for policy in policies]
                topo["runs"] += runs
                if sims is not None:  # after the seed's `none` run, whose tail they predict with
                    sims.fill(topo, runs)
                (ns.outdir / "overload_live.json").write_text(json.dumps(result, indent=1))
            if ns.retry_policy:
                run_name = f"{name}-x{mid:g}-{ns.retry_policy}-retry"
                bar.update(task, description=run_name)
                topo["retry_run"] = {"multiplier": mid, "rate": base * mid,
                                     "policy": ns.retry_policy,
                                     "live": live_run(setup, nodes, ns.retry_policy,
                                                      base * mid, run_name, retry=True)}
                bar.advance(task)
    result["host_speed"]["end"] = speed().as_dict()
    result["checks"] = checks(result)
    (ns.outdir / "overload_live.json").write_text(json.dumps(result, indent=1) + "\n")
    report(result, ns.outdir)
    return 0


def rotated(policies: list[str], k: int) -> list[str]:
    """``policies`` started at place ``k`` (mod their number): seed ``k``'s live order, so over
    as many seeds as policies each runs first, second, ... once, and a host that slows or
    speeds up within a seed's runs favours none of them."""
    k %= len(policies)
    return policies[k:] + policies[:k]


def checks(result: dict[str, Any]) -> dict[str, str]:
    """The issue's targets, evaluated per topology at the 2× runs (where present)."""
    out: dict[str, str] = {}
    for topo in result["topologies"]:
        at = mean_runs([r for r in topo["runs"] if r["multiplier"] == 2.0])
        if not {"none", "early_rejection", "predictive_early_rejection"} <= set(at):
            continue
        g = {k: v["live"]["goodput_rps"] for k, v in at.items()}
        n, e, pr = g["none"], g["early_rejection"], g["predictive_early_rejection"]
        name = topo["name"]
        out[f"{name} goodput pred >= early >= none"] = str(pr >= e >= n)
        out[f"{name} rejecting policies >= 1.2x none"] = str(min(e, pr) >= 1.2 * n)
        wp = at["predictive_early_rejection"]["live"]["wasted_tokens"]
        wn = at["none"]["live"]["wasted_tokens"]
        out[f"{name} thrown-away prefill pred <= 0.5x none"] = f"{wp <= 0.5 * wn} ({wp} vs {wn})"
        sp = at["predictive_early_rejection"]["live"]["load"]["prefill"]["swing"]
        se = at["early_rejection"]["live"]["load"]["prefill"]["swing"]
        out[f"{name} prefill swing pred < early"] = f"{sp < se} ({sp:.3f} vs {se:.3f})"
        rr = topo.get("retry_run")
        if rr:
            lv = rr["live"]
            out[f"{name} retried 429s then answered / within SLO"] = (
                f"{lv['retried_then_answered']} / {lv['retried_then_within_slo']} of "
                f"{lv['retried']} retried ({rr['policy']} at {rr['multiplier']:g}x)")
        sims = {k: v["sim"]["goodput_rps"] for k, v in at.items()}
        if all(math.isfinite(x) for x in sims.values()):
            order_live = sorted(g, key=g.__getitem__)
            order_sim = sorted(sims, key=sims.__getitem__)
            out[f"{name} sim order matches live"] = f"{order_live == order_sim} " \
                f"(live {order_live}, sim {order_sim})"
            errs = {k: (sims[k] - g[k]) / g[k] if g[k] else math.inf for k in g}
            out[f"{name} sim goodput within ±25 %"] = ", ".join(
                f"{k} {v:+.0%}" for k, v in errs.items())
            out[f"{name} sim engines beside each other / decode steps' tail"] = (
                f"x{topo.get('sim_stretch', 1.0):.3f} / {topo.get('sim_step_tail', 1.0):.3f}")
    return out


def mean_runs(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy, the mean over its repeats of what `checks` compares (goodput live and
    simulated, thrown-away prefill, prefill-load swing)."""
    out: dict[str, dict[str, Any]] = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = [r for r in runs if r["policy"] == policy]

        def mean(get: Any, mine: list[dict[str, Any]] = mine) -> float:
            return sum(get(r) for r in mine) / len(mine)

        out[policy] = {"live": {
            "goodput_rps": mean(lambda r: r["live"]["goodput_rps"]),
            "wasted_tokens": round(mean(lambda r: r["live"]["wasted_tokens"])),
            "load": {"prefill": {"swing": mean(lambda r: r["live"]["load"]["prefill"]["swing"])}}},
            "sim": {"goodput_rps": mean(lambda r: r["sim"]["goodput_rps"])}}
    return out


def spread(values: list[float]) -> dict[str, float]:
    """Mean, min and max of ``values`` (one per seed)."""
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def paired_interval(a: list[float], b: list[float], level: float = 0.9,
                    draws: int = 2000) -> tuple[float, float, float]:
    """Mean of ``a[i] - b[i]`` (the same seed's requests under two policies) and its
    bootstrap interval at ``level`` (seeds resampled with replacement, a fixed RNG)."""
    import random

    if len(a) != len(b) or not a:
        raise ValueError("paired_interval needs two equally long, non-empty lists")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    rng = random.Random(0)
    means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(draws))
    lo = means[int((1 - level) / 2 * draws)]
    hi = means[min(draws - 1, int((1 + level) / 2 * draws))]
    return sum(diffs) / len(diffs), lo, hi


def spread_table(goodput: dict[str, list[float]], header: str) -> str:
    """Per policy: goodput mean (min–max over seeds) and, against ``none`` on the same seeds,
    the ratio of means and the paired difference with its 90 % bootstrap interval."""
    lines = [f"| {header} | policy | goodput mean (min–max) req/s | / none | − none, paired "
             "(90 % interval) |", "|---|---|---|---|---|"]
    base = goodput.get("none")
    for policy, vals in goodput.items():
        sp = spread(vals)
        ratio = diff = "–"
        if base is not None and policy != "none" and len(base) == len(vals):
            m, lo, hi = paired_interval(vals, base)
            b = spread(base)["mean"]
            ratio = f"{sp['mean'] / b:.2f}×" if b > 0 else "–"
            diff = f"{m:+.3f} ({lo:+.3f} … {hi:+.3f})"
        lines.append(f"| {len(vals)} seeds | {policy} | {sp['mean']:.3f} ({sp['min']:.3f}–"
                     f"{sp['max']:.3f}) | {ratio} | {diff} |")
    return "\n".join(lines)


def spreads(result: dict[str, Any]) -> str:
    """`spread_table` of the live goodput (and the simulated, where run) per topology and
    multiplier: the runs of one seed share their requests and arrivals across policies."""
    parts = []
    for topo in result["topologies"]:
        for mult in dict.fromkeys(r["multiplier"] for r in topo["runs"]):
            runs = sorted((r for r in topo["runs"] if r["multiplier"] == mult),
                          key=lambda r: r["seed"])
            for side in ("live", "sim"):
                goodput: dict[str, list[float]] = {}
                for r in runs:
                    goodput.setdefault(r["policy"], []).append(r[side]["goodput_rps"])
                if all(math.isfinite(v) for vals in goodput.values() for v in vals):
                    parts.append(spread_table(goodput, f"{topo['name']} {mult:g}× {side}"))
    return "\n\n".join(parts)


def sim_only(setup: Setup, topologies: list[tuple[int, int]], bases: list[float],
             mults: list[float], policies: list[str], repeats: int, chosen: list[Path],
             tail: float, stretch: float, warm: bool = True, step_tail: float = 1.0) -> int:
    """The simulator alone (``--sim-only``): every policy on seeds ``setup.seed`` … + repeats-1
    (the same requests and arrivals per seed across policies), per topology and multiplier;
    ``warm``: the forecast's decode durations are `warm_durations` at the middle multiplier on
    seed + repeats (as the live benchmark's warm-up), else the simulator's own. ``chosen``:
    the predictor file per topology (or one for all); ``step_tail``: the decode steps' tail."""
    out: dict[str, Any] = {"predictors": [str(c) for c in chosen], "tbt_tail": tail,
                           "sim_step_tail": step_tail, "sim_stretch": stretch, "runs": []}
    md = []
    for i, (nodes, base) in enumerate(zip(topologies, bases, strict=True)):
        predictors = chosen[min(i, len(chosen) - 1)]
        name = f"{nodes[0]}P{nodes[1]}D"
        mid = sorted(mults)[len(mults) // 2]
        durations = warm_durations(replace(setup, seed=setup.seed + repeats), nodes, base * mid,
                                   predictors, tail, stretch, step_tail) if warm else ()
        out.setdefault("forecast_durations_s", {})[name] = list(durations)
        for mult in mults:
            goodput: dict[str, list[float]] = {p: [] for p in policies}
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
            for r in range(repeats):
                rs = replace(setup, seed=setup.seed + r)
                for policy in policies:
                    sim = sim_run(rs, nodes, policy, base * mult, predictors, tail, stretch,
                                  durations, step_tail)
                    goodput[policy].append(sim["goodput_rps"])
                    runs[policy].append(sim)
                    out["runs"].append({"cluster": name, "multiplier": mult, "seed": rs.seed,
                                        "policy": policy, **{k: v for k, v in sim.items()
                                                             if k != "samples"}})
            title = f"{name} {mult:g}× ({base * mult:.3g} req/s)"
            md += [spread_table(goodput, title), detail_table(runs, title)]
    (setup.out / "overload_sim.json").write_text(json.dumps(out, indent=1) + "\n")
    text = "\n\n".join(md)
    (setup.out / "overload_sim.md").write_text(text + "\n")
    print(text)
    return 0


def resim(live_dir: Path, out: Path, chosen: list[Path], stretch: float, warm: bool,
          step_tail: float | None = None) -> int:
    """``--resim``: the simulator columns of the live run in ``live_dir`` again, as the live
    benchmark runs them (each seed's policy tail the one its live ``none`` run learned, the
    forecast's durations from a simulated warm-up, the decode steps' tail ``step_tail`` or
    `step_tail_of` the run, the engines' slowdown beside each other ``stretch`` or the one
    its rate search measured), on ``chosen`` (per topology) or the start-up profiles in
    ``live_dir/logs/<cluster>-max``; the report written to ``out``."""
    result = json.loads((live_dir / "overload_live.json").read_text())
    conf = result["setup"]
    setup = Setup(out, conf["requests"], conf["seed"], conf["max_input"], conf["max_output"],
                  conf["ttft_slo_s"], conf["tbt_slo_s"], conf["sample_s"], conf["timeout_s"],
                  0, prefill_queue=conf.get("prefill_queue", DEFAULT_QUEUE))
    for i, topo in enumerate(result["topologies"]):
        nodes = parse_topology(topo["name"])
        try:
            pred = chosen[min(i, len(chosen) - 1)] if chosen else startup_predictors(
                live_dir / "logs" / f"{topo['name']}-max",
                out / f"{topo['name']}.startup.predictors.json")
        except ValueError as e:
            print(f"overload_live: --resim {topo['name']}: {e}; give --predictors",
                  file=sys.stderr)
            return 2
        topo["sim_predictors"] = str(pred)
        if not topo["runs"]:  # its search found no rate
            continue
        steps = topo["sim_step_tail"] = step_tail or step_tail_of(topo)
        factor = topo["sim_stretch"] = stretch or prefill_slowdown(
            live_dir / "logs" / f"{topo['name']}-max" / "conductor.log", pred)
        mults = sorted({r["multiplier"] for r in topo["runs"]})
        SimColumn(setup, nodes, pred, factor, steps, warm,
                  topo["max_rate"] * mults[len(mults) // 2],
                  setup.seed + conf["repeats"]).fill(topo, topo["runs"])
    result["checks"] = checks(result)
    (out / "overload_live.json").write_text(json.dumps(result, indent=1) + "\n")
    report(result, out)
    return 0


def report(result: dict[str, Any], out: Path) -> None:
    """``out/overload_live.md`` (the runs' table, the seeds' spreads, the checks and the host's
    speed), printed too, and the plots when any run was made (a live run's and a resim's)."""
    md = table(result) + "\n\n" + spreads(result) + "\n\n" + "\n".join(
        f"- {k}: {v}" for k, v in result["checks"].items())
    if result.get("host_speed"):
        md += "\n- host speed: " + host_speed_text(result["host_speed"])
    (out / "overload_live.md").write_text(md + "\n")
    if any(t["runs"] for t in result["topologies"]):
        plot(result, out)
    print(md)


def detail_table(runs: dict[str, list[dict[str, Any]]], header: str) -> str:
    """Per policy, means over its runs (simulated or live summaries): requests within SLO,
    rejected, TTFT p50 / p90, TBT p50 / p90 of the answered, mean prefill and decode load."""
    lines = [f"| {header} | policy | within SLO | rejected | TTFT p50 / p90 (s) | TBT p50 / p90 "
             "(ms) | prefill / decode load |", "|---|---|---|---|---|---|---|"]
    for policy, mine in runs.items():
        def mean(get: Any, mine: list[dict[str, Any]] = mine) -> float:
            vals = [v for v in (get(r) for r in mine) if v is not None]
            return sum(vals) / len(vals) if vals else math.nan

        lat = [mean(lambda r, k=k: r["latency"][k])
               for k in ("ttft_p50", "ttft_p90", "tbt_p50", "tbt_p90")]
        lines.append(f"| {len(mine)} runs | {policy} | {mean(lambda r: r['within_slo']):.1f} | "
                     f"{mean(lambda r: r['rejected']):.1f} | {lat[0]:.2f} / {lat[1]:.2f} | "
                     f"{lat[2] * 1e3:.0f} / {lat[3] * 1e3:.0f} | "
                     f"{mean(lambda r: r['load']['prefill']['mean']):.2f} / "
                     f"{mean(lambda r: r['load']['decode']['mean']):.2f} |")
    return "\n".join(lines)


def machine() -> str:
    """This processor as the predictors name it (`yuebing.core.host.cpu_name`) and its cores."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def host_speed_text(speeds: dict[str, dict[str, float]]) -> str:
    """``host_speed`` ({"start": ..., "end": ...} of `HostSpeed.as_dict`) as one line."""
    return "; ".join(f"{when} {s['python_ns']:.1f} ns per Python loop, {s['copy_gbps']:.2f} GB/s "
                     "copy" for when, s in speeds.items())


if __name__ == "__main__":
    sys.exit(main())
