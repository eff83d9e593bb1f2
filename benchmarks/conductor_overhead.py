"""Conductor overhead and throughput (issue 13, Performance), with instances on dummy models.

Starts real processes on 127.0.0.1 — P prefill + D decode instances (or K coupled),
``yuebing serve conductor`` in front of them and, for the throughput phase, a bare
Starlette/uvicorn echo server (the same HTTP stack, no Conductor logic) — then, from one asyncio
(aiohttp) client in this process:

1. overhead (instances on ``--overhead-model``, default ``dummy``: SmolLM2-135M's shape with
   random weights, so decode steps take what the real model's take and tokens arrive at a
   real pace): ``--streams`` concurrent streaming completions (``--tokens`` each) until
   ``--requests`` are done; the Conductor's own histograms give the overhead, read from
   ``/metrics`` before and after: ``yuebing:conductor_dispatch_seconds`` (HTTP arrival → task
   sent, the wait for the prefill turn and the decode reservation's round trip excluded) and
   ``yuebing:conductor_relay_seconds`` (a token event's frame read from the instance's socket →
   its chunk handed to the HTTP transport). p50/p99 are interpolated inside the histogram
   buckets; the 1 ms and 5 ms targets are bucket bounds, so "share ≤ 1 ms / ≤ 5 ms" is exact.
2. throughput (instances on ``--rate-model``, default ``dummy:preset=tiny``): one-token
   non-streamed requests at ``--concurrency`` for ``--seconds``, against the Conductor and then
   the echo server; requests/s, their ratio and the CPU per request of each process.

    .venv/bin/python benchmarks/conductor_overhead.py [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from yuebing.ops.procs import ReadyProcess, stop_all

MODEL = "dummy:preset=tiny"
ECHO_BODY = {"id": "cmpl-echo", "object": "text_completion", "created": 0, "model": MODEL,
             "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def echo_server(ready_file: str) -> None:
    """The bare stack: Starlette + uvicorn (uvloop, httptools: what the Conductor runs on)
    answering /v1/completions with a fixed body."""
    import socket

    import msgspec
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    body = msgspec.json.encode(ECHO_BODY)

    async def completions(request: Request) -> Response:
        msgspec.json.decode(await request.body())
        return Response(body, media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    Path(ready_file).write_text(json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}"}))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(
        sockets=[sock])


class Procs:
    """The benchmark's processes (`yuebing.ops.procs.ReadyProcess`, their logs and ready files
    in one folder), stopped together."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="yb-bench-conductor-"))
        self.procs: list[ReadyProcess] = []
        self.pids: dict[str, int] = {}

    def start(self, name: str, argv: list[str], timeout_s: float = 300.0) -> dict[str, Any]:
        p = ReadyProcess(argv, name=name, workdir=self.dir, timeout_s=timeout_s)
        self.procs.append(p)
        self.pids[name] = p.proc.pid
        time.sleep(0.05)
        return p.info

    def stop(self) -> None:
        stop_all(reversed(self.procs))
        self.procs.clear()


def histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float]:
    """Cumulative (upper bound, count) buckets and the total count of ``name``."""
    buckets = []
    for m in re.finditer(rf'^{re.escape(name)}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M):
        buckets.append((float(m.group(1)), float(m.group(2))))
    count = re.search(rf"^{re.escape(name)}_count (\S+)$", text, re.M)
    return buckets, float(count.group(1)) if count else 0.0


def delta_stats(before: str, after: str, name: str) -> dict[str, float]:
    b0, n0 = histogram(before, name)
    b1, n1 = histogram(after, name)
    base = dict(b0)
    buckets = [(le, c - base.get(le, 0.0)) for le, c in b1]
    n = n1 - n0

    def quantile(q: float) -> float:
        target, lo, prev = q * n, 0.0, 0.0
        for le, c in buckets:
            if c >= target:
                if le == float("inf"):
                    return lo
                return lo + (le - lo) * ((target - prev) / (c - prev) if c > prev else 1.0)
            lo, prev = le, c
        return float("nan")

    share = {le: c / n for le, c in buckets} if n else {}
    return {"count": n, "p50_ms": 1e3 * quantile(0.5), "p99_ms": 1e3 * quantile(0.99),
            "share_le_1ms": share.get(0.001, float("nan")),
            "share_le_5ms": share.get(0.005, float("nan"))}


class _StreamConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that reads streamed (chunked) responses with as
    little CPU as a client can: it only looks for the status line and the final chunk. The
    overhead phase measures the Conductor, and the load generator shares its two cores; an
    HTTP client library parsing every SSE line (aiohttp: ~4x this one's CPU per token) takes
    the core the Conductor needs at the moment tokens arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[bytes] | None = None
        self.head = b""
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if len(self.head) < 12:
            self.head += data[:12]
        self.tail = (self.tail + data)[-7:]
        if self.tail == b"\r\n0\r\n\r\n" and self.done is not None and not self.done.done():
            self.done.set_result(self.head)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def request(self, raw: bytes) -> None:
        assert self.transport is not None
        self.head, self.tail = b"", b""
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        head = await self.done
        assert head.startswith(b"HTTP/1.1 200"), head


async def streams(url: str, n_streams: int, n_requests: int, tokens: int,
                  model: str, ramp_s: float = 0.0) -> float:
    """``n_streams`` connections each sending streamed completions until ``n_requests`` are
    done; the wall time. Connection ``i`` starts ``i * ramp_s / n_streams`` in: started all at
    once, the streams would stay in lockstep (same length, same decode batch) and arrive,
    get their first token and finish in waves of ``n_streams`` at the same instant — not the
    steady state of 50 concurrent streams the target is about."""
    left = n_requests
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": model, "prompt": list(range(1, 65)), "max_tokens": tokens,
                       "stream": True, "ignore_eos": True}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json"
           f"\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()

    async def worker(i: int) -> None:
        nonlocal left
        await asyncio.sleep(i * ramp_s / n_streams)
        _, conn = await loop.create_connection(_StreamConn, host, int(port))
        try:
            while left > 0:
                left -= 1
                await conn.request(raw)
        finally:
            assert conn.transport is not None
            conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(n_streams)))
    return time.perf_counter() - t0


async def rate(url: str, concurrency: int, seconds: float,
               model: str = MODEL) -> dict[str, float]:
    import aiohttp

    done, failed = 0, 0
    end = time.perf_counter() + seconds
    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 1}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, failed
        while time.perf_counter() < end:
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1
                else:
                    failed += 1

    t0 = time.perf_counter()
    conn = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return {"requests_per_s": done / (time.perf_counter() - t0), "failed": failed}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def start_cluster(procs: Procs, roles: list[str], model: str, tag: str,
                  instance_args: list[str] | None = None) -> tuple[str, int, list[int]]:
    """Instances on ``model`` (with ``instance_args``) and a Conductor before them; (url,
    conductor pid, instance pids)."""
    yb = [sys.executable, "-m", "yuebing.cli.main"]
    addresses, pids = [], []
    for i, role in enumerate(roles):
        name = f"{tag}-{role}-{i}"
        hello = procs.start(name, [*yb, "serve", role, "--model", model, "--instance-id", name,
                                   *(instance_args or [])])
        addresses.append(hello["control_address"])
        pids.append(procs.pids[name])
    ready = procs.start(f"{tag}-conductor", [
        *yb, "serve", "conductor", "--model", model, "--port", "0", "--instances",
        ",".join(addresses), "--no-access-log", "--max-concurrent", "4096"])
    url = ready["url"]
    while True:  # every instance joined
        import urllib.request
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            h = json.loads(r.read())
        if sum(len(v) for v in h["instances"].values()) == len(roles):
            return url, int(ready["pid"]), pids
        time.sleep(0.2)


def overhead_phase(procs: Procs, roles: list[str], ns: argparse.Namespace) -> dict[str, Any]:
    url, pid, _ = start_cluster(procs, roles, ns.overhead_model, "overhead",
                                ns.instance_args.split())
    m = ns.overhead_model
    asyncio.run(streams(url, 4, 8, 4, m))  # warm-up
    before, cpu0 = scrape(url), cpu_s(pid)
    wall = asyncio.run(streams(url, ns.streams, ns.requests, ns.tokens, m, ns.ramp_s))
    after, cpu1 = scrape(url), cpu_s(pid)
    procs.stop()
    return {"model": ns.overhead_model, "wall_s": wall,
            "conductor_cpu_ms_per_stream_request": 1e3 * (cpu1 - cpu0) / ns.requests,
            "dispatch": delta_stats(before, after, "yuebing:conductor_dispatch_seconds"),
            "relay": delta_stats(before, after, "yuebing:conductor_relay_seconds")}


def rate_phase(procs: Procs, roles: list[str], ns: argparse.Namespace) -> dict[str, Any]:
    url, pid, inst = start_cluster(procs, roles, ns.rate_model, "rate", ns.instance_args.split())
    echo = procs.start("echo", [sys.executable, __file__, "--echo-server"])["url"]
    asyncio.run(rate(url, 4, 1.0, ns.rate_model))  # warm-up
    cpu0, inst0, me0 = cpu_s(pid), [cpu_s(p) for p in inst], time.process_time()
    conductor = asyncio.run(rate(url, ns.concurrency, ns.seconds, ns.rate_model))
    n = max(1.0, conductor["requests_per_s"] * ns.seconds)
    conductor["cpu_ms_per_request"] = 1e3 * (cpu_s(pid) - cpu0) / n
    per = [1e3 * (cpu_s(p) - c0) / n for p, c0 in zip(inst, inst0, strict=True)]
    conductor["instances_cpu_ms_per_request"] = sum(per)
    conductor["instance_cpu_ms_per_request"] = {
        f"{role}-{i}": round(c, 3) for i, (role, c) in enumerate(zip(roles, per, strict=True))}
    conductor["client_cpu_ms_per_request"] = 1e3 * (time.process_time() - me0) / n
    echo_pid, me1 = procs.pids["echo"], time.process_time()
    echo0 = cpu_s(echo_pid)
    echo_rate = asyncio.run(rate(echo, ns.concurrency, ns.seconds))
    m = max(1.0, echo_rate["requests_per_s"] * ns.seconds)
    echo_rate["cpu_ms_per_request"] = 1e3 * (cpu_s(echo_pid) - echo0) / m
    echo_rate["client_cpu_ms_per_request"] = 1e3 * (time.process_time() - me1) / m
    procs.stop()
    return {"model": ns.rate_model, "conductor_one_token": conductor, "echo": echo_rate,
            "ratio": conductor["requests_per_s"] / echo_rate["requests_per_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--coupled", type=int, default=0, help="use K coupled instances instead")
    ap.add_argument("--overhead-model", default="dummy",
                    help="instances' model for the overhead phase (default: dummy = "
                         "SmolLM2-135M's shape, random weights: real step times)")
    ap.add_argument("--rate-model", default=MODEL,
                    help=f"instances' model for the throughput phase (default: {MODEL})")
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ramp-s", type=float, default=3.0,
                    help="spread the streams' starts over this many seconds (0: all at once)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--instance-args", default="",
                    help="extra flags for every instance, e.g. --instance-args='--event-loop asyncio'")
    ap.add_argument("--skip", choices=("overhead", "rate"), default=None,
                    help="leave one phase out")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", default="", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.echo_server:
        echo_server(ns.ready_file)
        return 0
    roles = ["coupled"] * ns.coupled or ["prefill"] * ns.prefill + ["decode"] * ns.decode
    result: dict[str, Any] = {"setup": {
        "roles": roles, "streams": ns.streams, "requests": ns.requests, "tokens": ns.tokens,
        "concurrency": ns.concurrency, "seconds": ns.seconds,
        "loadavg_before": os.getloadavg()[0]}}
    procs = Procs()
    try:
        if ns.skip != "overhead":
            result["overhead"] = overhead_phase(procs, roles, ns)
        if ns.skip != "rate":
            result["throughput"] = rate_phase(procs, roles, ns)
    finally:
        procs.stop()
    result["setup"]["loadavg_after"] = os.getloadavg()[0]
    if ns.json:
        print(json.dumps(result, indent=2))
        return 0
    if "overhead" in result:
        o = result["overhead"]
        for k in ("dispatch", "relay"):
            s = o[k]
            print(f"{k:9s} n={s['count']:.0f} p50={s['p50_ms']:.3f} ms p99={s['p99_ms']:.3f} ms "
                  f"≤1ms {100 * s['share_le_1ms']:.1f}% ≤5ms {100 * s['share_le_5ms']:.1f}%")
        print(f"conductor CPU per streamed request ({ns.tokens} tokens, {o['model']}): "
              f"{o['conductor_cpu_ms_per_stream_request']:.2f} ms")
    if "throughput" in result:
        t = result["throughput"]
        c, e = t["conductor_one_token"], t["echo"]
        print(f"one-token requests/s ({t['model']}): conductor {c['requests_per_s']:.0f}, "
              f"echo {e['requests_per_s']:.0f}, ratio {t['ratio']:.3f}")
        print("CPU ms per one-token request: conductor {cpu_ms_per_request:.2f}, instances "
              "{instances_cpu_ms_per_request:.2f}, client {client_cpu_ms_per_request:.2f}"
              .format(**c))
        print("  per instance: " + ", ".join(
            f"{k} {v:.2f}" for k, v in c["instance_cpu_ms_per_request"].items()))
        print("CPU ms per echo request: server {cpu_ms_per_request:.2f}, client "
              "{client_cpu_ms_per_request:.2f}".format(**e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
