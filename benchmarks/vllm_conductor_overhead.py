"""Conductor overhead on vLLM instances (issue 31): ``yuebing serve --engine vllm`` (1P1D by
default) on this host, ``--requests`` short greedy chat completions, ``--concurrency`` at a
time; the Conductor's own histograms, read from ``/metrics`` before and after, give its
dispatch time (``yuebing:conductor_dispatch_seconds``: HTTP arrival → task sent, the wait for
the prefill turn and the decode reservation's round trip excluded; target p99 ≤ 5 ms) and its
relay time per token event (``yuebing:conductor_relay_seconds``), as in
``benchmarks/conductor_overhead.py`` (whose bucket interpolation this reuses), and where the
dispatch time goes (``yuebing:conductor_dispatch_phase_seconds``: body, parse, start, route,
send) and its garbage collections (``yuebing:conductor_gc_seconds``). With ``--renice N`` the
same load runs a second time in the same cluster with the Conductor's process at nice N. With
``--nice-vllm N`` rounds alternate (A, B, A, B, ...: ``--rounds``) between the vLLM servers at
nice 0 and at nice N, every thread of theirs (going back needs root; without it the rounds stop
after the first B). With ``--flags-a`` / ``--flags-b`` (e.g. ``--flags-a='--engine-nice 0'``)
clusters alternate instead, one per arm and round (A B, B A, ...: ``--pairs``), each reporting
its dispatch p50/p99, req/s and the nice, policy and autogroup of each process. Prints JSON,
with ``target_met``: dispatch p99 ≤ ``--target-ms``. The whole run is bounded by
``--timeout-s`` (the cluster is stopped and the run fails, naming the limit). The vLLM
instances start without their start-up profile (the dispatch does not depend on it;
``--startup-profile`` takes it, cached after a first start).

Usage:  PYTHONPATH=src .venv/bin/python benchmarks/vllm_conductor_overhead.py
        [--requests 40] [--concurrency 4] [--roles "--prefill 1 --decode 1"] [--renice -10]
        [--nice-vllm 10 --rounds 4] [--flags-a='--engine-nice 0' --flags-b='' --pairs 2]
        [--timeout-s 900] [--target-ms 5] [--startup-profile]
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
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conductor_overhead import delta_stats  # noqa: E402

from yuebing.ops.ports import free_port  # noqa: E402
from yuebing.ops.procs import yuebing_argv  # noqa: E402

PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write a haiku about the sea.", "What is 12 times 12?"]


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


def descendants(root: int) -> list[int]:
    """The pids under ``root`` (children, their children, ...): the roles of ``yuebing serve``
    each lead a session of their own, and so do the vLLM servers the adapters start."""
    parent: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        out += kids
        todo += kids
    return out


def vllm_pids(serve_pid: int) -> list[int]:
    """The vLLM processes (API servers, engine cores) under ``yuebing serve``, not yuebing's."""
    out = []
    for pid in descendants(serve_pid):
        with contextlib.suppress(OSError):
            if b"yuebing.cli.main" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


def vllm_threads(serve_pid: int) -> list[int]:
    """Every thread of the vLLM processes under ``yuebing serve``."""
    tids = []
    for pid in vllm_pids(serve_pid):
        with contextlib.suppress(OSError, ValueError):
            tids += [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    return tids


def priorities(serve_pid: int) -> dict[str, str]:
    """Per process under ``yuebing serve`` (name: the role or vLLM's title): its nice, policy
    and autogroup, to show what the engine priority did."""
    out = {}
    for pid in descendants(serve_pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            name = (argv[argv.index(b"--instance-id") + 1].decode() if b"--instance-id" in argv
                    else " ".join(a.decode() for a in argv[3:5]) if b"yuebing.cli.main" in argv
                    else Path(f"/proc/{pid}/comm").read_text().strip())
            policy = {0: "normal", 3: "batch", 5: "idle"}.get(os.sched_getscheduler(pid), "?")
            group = Path(f"/proc/{pid}/autogroup").read_text().split()
            out[f"{pid} {name}"] = (f"nice {os.getpriority(os.PRIO_PROCESS, pid)} {policy}, "
                                    f"autogroup {group[0].rsplit('-', 1)[-1]} nice {group[-1]}")
    return out


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
    """``n`` chats, ``concurrency`` at a time: the answered ones' latencies (fewer than ``n``
    where some failed: a 503 on a host too loaded for an instance's reports), wall time,
    /metrics before, after."""
    def one(i: int) -> float | None:
        try:
            return chat(url, PROMPTS[i % len(PROMPTS)])
        except OSError as e:  # urllib's HTTPError and URLError included
            print(f"request {i}: {e}", file=sys.stderr, flush=True)
            return None

    before = metrics(url)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        latencies = [x for x in pool.map(one, range(n)) if x is not None]
    return latencies, time.perf_counter() - t0, before, metrics(url)


def mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 3) if xs else float("nan")


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
        arms[arm].append((before, after, mean(lat)))
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


class Cluster:
    """``yuebing serve --engine vllm`` with ``flags``, waited for until ready (put in
    ``started`` before, so a timeout while it starts stops it too); `stop`."""

    def __init__(self, ns: argparse.Namespace, started: list[Cluster], flags: str = "") -> None:
        port = free_port("127.0.0.1")
        self.logs = Path(tempfile.mkdtemp(prefix="yb-vllm-overhead-"))
        self.url = f"http://127.0.0.1:{port}"
        profile = () if ns.startup_profile else ("--no-startup-profile",)
        self.proc = subprocess.Popen(
            yuebing_argv(["serve", "--engine", "vllm", *shlex.split(ns.roles), *profile,
                          *shlex.split(flags), "--port", str(port), "--log-dir",
                          str(self.logs)]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        started.append(self)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "yuebing serve: ready" in line:
                break
            if "failed" in line:
                self.stop()
                raise SystemExit(line)
        else:
            raise SystemExit(f"yuebing serve exited with {self.proc.wait()} before it was "
                             f"ready (logs in {self.logs})")
        for p in PROMPTS[:2]:
            chat(self.url, p)  # warm-up

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the load's requests fail at once
            os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.returncode is not None:  # stopped before
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=120)


def ab_flags(ns: argparse.Namespace, clusters: list[Cluster]) -> dict[str, object]:
    """``--pairs`` pairs of clusters, one with ``--flags-a`` (A) and one with ``--flags-b``
    (B), in the order A B, B A, A B, ...: per arm and cluster, the dispatch p50 and p99,
    req/s of the load, and each process's priority."""
    arms: dict[str, list[dict[str, object]]] = {"A": [], "B": []}
    for i in range(ns.pairs):
        for arm in ("AB" if i % 2 == 0 else "BA"):
            c = Cluster(ns, clusters, ns.ab[0] if arm == "A" else ns.ab[1])
            prio = priorities(c.proc.pid)
            lat, wall, before, after = load(c.url, ns.requests, ns.concurrency)
            c.stop()
            clusters.clear()
            d = delta_stats(before, after, "yuebing:conductor_dispatch_seconds")
            arms[arm].append({"p50_ms": round(d["p50_ms"], 3), "p99_ms": round(d["p99_ms"], 2),
                              "req_per_s": round(len(lat) / wall, 3),
                              "failed": ns.requests - len(lat), "mean_latency_s": mean(lat),
                              "priorities": prio})
            print(f"pair {i} {arm} ({ns.ab['AB'.index(arm)] or 'defaults'}): "
                  f"{json.dumps({k: v for k, v in arms[arm][-1].items() if k != 'priorities'})}",
                  file=sys.stderr, flush=True)
    return {"A": ns.ab[0], "B": ns.ab[1], "runs": arms}


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
    ap.add_argument("--flags-a", default=None,
                    help="instead: clusters with these extra serve flags (A) and --flags-b's "
                         "(B), alternated A B, B A, ... (--pairs); write --flags-a='--x 1'")
    ap.add_argument("--flags-b", default="", help="B's extra serve flags ('' = the defaults)")
    ap.add_argument("--pairs", type=int, default=2, help="pairs of --ab clusters")
    ns = ap.parse_args()
    if ns.requests < 1 or ns.concurrency < 1 or ns.timeout_s < 1 or ns.pairs < 1:
        ap.error("--requests, --concurrency, --pairs and --timeout-s must be >= 1")
    clusters: list[Cluster] = []

    def expired(signum: int, frame: object) -> None:
        for c in clusters:
            c.kill()
        raise SystemExit(f"vllm_conductor_overhead: not done within --timeout-s "
                         f"{ns.timeout_s} s; stopped")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(ns.timeout_s)
    try:
        if ns.flags_a is not None:
            ns.ab = (ns.flags_a, ns.flags_b)
            out: dict[str, object] = {"roles": ns.roles, "requests": ns.requests,
                                      "concurrency": ns.concurrency, "ab": ab_flags(ns, clusters)}
        else:
            out = one_cluster(ns, clusters)
    finally:
        signal.alarm(0)
        for c in clusters:
            c.stop()
    out["loadavg"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(json.dumps(out, indent=2))
    return 0


def one_cluster(ns: argparse.Namespace, clusters: list[Cluster]) -> dict[str, object]:
    """One cluster at the defaults: the load, then the ``--renice`` / ``--nice-vllm`` rounds."""
    c = Cluster(ns, clusters)
    prio = priorities(c.proc.pid)
    latencies, wall, before, after = load(c.url, ns.requests, ns.concurrency)
    reniced: dict[str, object] = {}
    if ns.renice is not None:
        os.setpriority(os.PRIO_PROCESS, conductor_pid(c.proc.pid), ns.renice)
        _, _, b2, a2 = load(c.url, ns.requests, ns.concurrency)
        reniced = {"renice": ns.renice, "dispatch_reniced": delta_stats(
            b2, a2, "yuebing:conductor_dispatch_seconds")}
    if ns.nice_vllm is not None:
        reniced["nice_vllm"] = ab_nice(c.proc.pid, c.url, ns)
    dispatch = delta_stats(before, after, "yuebing:conductor_dispatch_seconds")
    return {"roles": ns.roles, "requests": ns.requests, "concurrency": ns.concurrency,
            "wall_s": round(wall, 2), "req_per_s": round(len(latencies) / wall, 3),
            "failed": ns.requests - len(latencies), "mean_latency_s": mean(latencies),
            "dispatch": dispatch, "target_p99_ms": ns.target_ms,
            "target_met": dispatch["p99_ms"] <= ns.target_ms,
            "relay": delta_stats(before, after, "yuebing:conductor_relay_seconds"),
            "dispatch_phases": phases(before, after),
            "gc": labelled(before, after, "yuebing:conductor_gc_seconds", "generation",
                           ("0", "1", "2")), **reniced, "priorities": prio,
            "logs": str(c.logs)}


if __name__ == "__main__":
    sys.exit(main())
