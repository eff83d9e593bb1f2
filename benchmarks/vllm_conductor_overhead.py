"""Conductor overhead on vLLM instances (issue 31): ``yuebing serve --engine vllm`` (1P1D by
default) on this host, ``--requests`` short greedy chat completions, ``--concurrency`` at a
time; the Conductor's own histograms, read from ``/metrics`` before and after, give its
dispatch time (``yuebing:conductor_dispatch_seconds``: HTTP arrival → task sent, the wait for
the prefill turn and the decode reservation's round trip excluded; target p99 ≤ 5 ms) and its
relay time per token event (``yuebing:conductor_relay_seconds``), as in
``benchmarks/conductor_overhead.py`` (whose bucket interpolation this reuses), and where the
dispatch time goes (``yuebing:conductor_dispatch_phase_seconds``: body, parse, start, route,
send) and its garbage collections (``yuebing:conductor_gc_seconds``). With ``--renice N`` the
same load runs a second time in the same cluster with the Conductor's process at nice N. With ``--nice-vllm N`` rounds alternate (A, B, A,
B, ...: ``--rounds``) between the vLLM servers at their nice and at nice N, every thread of
theirs (going back needs root; without it the rounds stop after the first B). Prints JSON,
with ``target_met``: dispatch p99 ≤ ``--target-ms``. The whole run is bounded by
``--timeout-s`` (the cluster is stopped and the run fails, naming the limit). The vLLM
instances start without their start-up profile (the dispatch does not depend on it;
``--startup-profile`` takes it, cached after a first start).

Usage:  PYTHONPATH=src .venv/bin/python benchmarks/vllm_conductor_overhead.py
        [--requests 40] [--concurrency 4] [--roles "--prefill 1 --decode 1"] [--renice -10]
        [--nice-vllm 10 --rounds 4] [--timeout-s 900] [--target-ms 5] [--startup-profile]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conductor_overhead import delta_stats  # noqa: E402

from yuebing.ops.procs import yuebing_argv  # noqa: E402

PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write a haiku about the sea.", "What is 12 times 12?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(url: str, content: str) -> float:
    body = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    t = time.perf_counter()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.perf_counter() - t


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def conductor_pid(serve_pid: int) -> int:
    """The pid of the Conductor child of ``yuebing serve`` (pid ``serve_pid``)."""
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(stat[1]) == serve_pid and b"serve" in argv and b"conductor" in argv:
            return int(proc.name)
    raise SystemExit("no Conductor process found")


PHASES = ("body", "parse", "start", "route", "send")
PHASE = "yuebing:conductor_dispatch_phase_seconds"


def labelled(before: str, after: str, name: str, label: str,
             values: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """`delta_stats` of histogram ``name`` for each value of its ``label``."""
    def only(text: str, value: str) -> str:
        keep = re.compile(rf'^{re.escape(name)}_(bucket|count)\{{(.*?){label}="{value}"(.*?)\}}'
                          r" (\S+)$", re.M)
        out = []
        for m in keep.finditer(text):
            labels = ",".join(x for x in (m.group(2) + m.group(3)).split(",") if x)
            out.append(f"{name}_{m.group(1)}" + (f"{{{labels}}}" if labels else "") +
                       f" {m.group(4)}")
        return "\n".join(out)
    return {v: delta_stats(only(before, v), only(after, v), name) for v in values}


def phases(before: str, after: str) -> dict[str, dict[str, float]]:
    """`delta_stats` of each phase of the dispatch histogram."""
    return labelled(before, after, PHASE, "phase", PHASES)


def vllm_threads(serve_pid: int) -> list[int]:
    """Every thread of the vLLM processes (API server, engine core) under ``yuebing serve``
    (its session), not of yuebing's own processes."""
    tids = []
    for proc in Path("/proc").iterdir():
        try:
            sid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3])
            argv = (proc / "cmdline").read_bytes()
            if sid != serve_pid or b"yuebing" in argv or int(proc.name) == serve_pid:
                continue
            tids += [int(t.name) for t in (proc / "task").iterdir()]
        except (OSError, IndexError, ValueError):
            continue
    return tids


def renice(tids: list[int], nice: int) -> bool:
    """Set each thread's nice; False where that is not allowed (lowering it needs root)."""
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:
        return False
    return True


def load(url: str, n: int, concurrency: int) -> tuple[list[float], float, str, str]:
    """``n`` chats, ``concurrency`` at a time: latencies, wall time, /metrics before, after."""
    before = metrics(url)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(lambda i: chat(url, PROMPTS[i % len(PROMPTS)]), range(n)))
    return latencies, time.perf_counter() - t0, before, metrics(url)


def ab_nice(serve_pid: int, url: str, ns: argparse.Namespace) -> dict[str, object]:
    """Rounds A (vLLM at nice 0), B (at ``--nice-vllm``), A, B, ...: per arm, the dispatch
    p50/p99 (and the route phase's p99) of each round, and the mean request latency."""
    arms: dict[str, list[tuple[str, str, float]]] = {"A": [], "B": []}
    for i in range(ns.rounds):
        arm = "AB"[i % 2]
        if not renice(vllm_threads(serve_pid), ns.nice_vllm if arm == "B" else 0):
            print(f"round {i}: cannot renice vLLM back to 0 without root; stopping",
                  file=sys.stderr)
            break
        lat, _, before, after = load(url, ns.requests, ns.concurrency)
        arms[arm].append((before, after, sum(lat) / len(lat)))
    out: dict[str, object] = {"nice_b": ns.nice_vllm}
    for arm, runs in arms.items():
        if not runs:
            continue
        per = [delta_stats(b, a, "yuebing:conductor_dispatch_seconds") for b, a, _ in runs]
        merged = {"rounds": len(runs), "p99_ms_per_round": [round(p["p99_ms"], 2) for p in per],
                  "p50_ms_per_round": [round(p["p50_ms"], 3) for p in per],
                  "route_p99_ms_per_round": [round(phases(b, a)["route"]["p99_ms"], 2)
                                             for b, a, _ in runs],
                  "mean_latency_s": round(sum(r[2] for r in runs) / len(runs), 3)}
        out[arm] = merged
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--roles", default="--prefill 1 --decode 1")
    ap.add_argument("--renice", type=int, default=None,
                    help="run the load again with the Conductor at this nice value")
    ap.add_argument("--nice-vllm", type=int, default=None,
                    help="alternate rounds with the vLLM servers at this nice value")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of --nice-vllm (A, B, ...)")
    ap.add_argument("--timeout-s", type=int, default=900,
                    help="stop everything and fail if the run takes longer (start included)")
    ap.add_argument("--target-ms", type=float, default=5.0, help="dispatch p99 target")
    ap.add_argument("--startup-profile", action="store_true",
                    help="let the vLLM instances take their start-up profile")
    ns = ap.parse_args()
    if ns.requests < 1 or ns.concurrency < 1 or ns.timeout_s < 1:
        ap.error("--requests, --concurrency and --timeout-s must be >= 1")
    port, logs = free_port(), Path(tempfile.mkdtemp(prefix="yb-vllm-overhead-"))
    url = f"http://127.0.0.1:{port}"
    profile = () if ns.startup_profile else ("--no-startup-profile",)
    proc = subprocess.Popen(yuebing_argv(["serve", "--engine", "vllm", *shlex.split(ns.roles),
                                          *profile, "--port", str(port),
                                          "--log-dir", str(logs)]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def expired(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):  # the load's requests fail at once
            os.killpg(proc.pid, signal.SIGTERM)
        raise SystemExit(f"vllm_conductor_overhead: not done within --timeout-s "
                         f"{ns.timeout_s} s; stopped (logs in {logs})")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(ns.timeout_s)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "yuebing serve: ready" in line:
                break
            if "failed" in line:
                raise SystemExit(line)
        else:
            raise SystemExit(f"yuebing serve exited with {proc.wait()} before it was ready "
                             f"(logs in {logs})")
        for p in PROMPTS[:2]:
            chat(url, p)  # warm-up
        latencies, wall, before, after = load(url, ns.requests, ns.concurrency)
        reniced = {}
        if ns.renice is not None:
            pid = conductor_pid(proc.pid)
            os.setpriority(os.PRIO_PROCESS, pid, ns.renice)
            _, _, b2, a2 = load(url, ns.requests, ns.concurrency)
            reniced = {"renice": ns.renice, "dispatch_reniced": delta_stats(
                b2, a2, "yuebing:conductor_dispatch_seconds")}
        if ns.nice_vllm is not None:
            reniced["nice_vllm"] = ab_nice(proc.pid, url, ns)
    finally:
        signal.alarm(0)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    dispatch = delta_stats(before, after, "yuebing:conductor_dispatch_seconds")
    out = {"roles": ns.roles, "requests": ns.requests, "concurrency": ns.concurrency,
           "wall_s": round(wall, 2), "mean_latency_s": round(sum(latencies) / len(latencies), 3),
           "dispatch": dispatch, "target_p99_ms": ns.target_ms,
           "target_met": dispatch["p99_ms"] <= ns.target_ms,
           "relay": delta_stats(before, after, "yuebing:conductor_relay_seconds"),
           "dispatch_phases": phases(before, after),
           "gc": labelled(before, after, "yuebing:conductor_gc_seconds", "generation",
                          ("0", "1", "2")), **reniced,
           "logs": str(logs), "loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
