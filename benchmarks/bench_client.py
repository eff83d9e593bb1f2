"""Benchmark: the load generator's own cost and timing error (`yuebing bench serve`'s client).

On a 2-core machine the client shares the CPU with the server it measures, so two numbers
matter: how much CPU the client spends per streamed token (it competes with the server), and
how far its per-token timestamps are from the server's own schedule (its timing error).

A minimal OpenAI-style SSE server (raw asyncio, one process of its own, ~no CPU per event) is
started on 127.0.0.1; it sends each request's tokens on an absolute schedule of one every
``--interval-ms`` (0: as fast as it can). The script runs `yuebing.bench.runner.run_bench`
against it and reports:

- *cost*: client CPU seconds (``time.process_time``) per streamed token and per request,
  with ``--interval-ms 0`` (the client is the bottleneck);
- *timing*: with tokens every ``--interval-ms``, the client's mean ITL and TBT against the
  server's interval, at ``--concurrency`` streams in flight.

    .venv/bin/python benchmarks/bench_client.py [--requests 200] [--tokens 256] \
        [--concurrency 32] [--interval-ms 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time
from typing import Any

from yuebing.bench.config import BenchConfig
from yuebing.bench.runner import run_bench
from yuebing.bench.workload import BenchRequest


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  interval_s: float) -> None:
    """One HTTP/1.1 request per connection (answers with ``Connection: close``)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    path = lines[0].split(" ")[1]
    length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith(
        "content-length:")), 0)
    body = json.loads(await reader.readexactly(length)) if length else {}
    if path == "/v1/models":
        payload = b'{"data": [{"id": "m"}]}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(payload)).encode() + b"\r\nConnection: close\r\n\r\n" + payload)
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        n = int(body["max_tokens"])
        for i in range(n):
            # an absolute schedule (no drift); with no interval, still yield between tokens
            # so the streams interleave as a real server's do
            await asyncio.sleep(max(0.0, t0 + i * interval_s - loop.time()) if interval_s else 0)
            writer.write(b'data: {"choices": [{"index": 0, "text": " x"}]}\n\n')
            await writer.drain()
        writer.write(b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": '
                     + str(n).encode() + b"}}\n\ndata: [DONE]\n\n")
    await writer.drain()
    writer.close()


def _serve(port_q: Any, interval_s: float) -> None:
    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _handle(r, w, interval_s), "127.0.0.1", 0)
        port_q.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def _measure(requests: int, tokens: int, concurrency: int, interval_s: float) -> dict[str, Any]:
    q: Any = mp.Queue()
    proc = mp.Process(target=_serve, args=(q, interval_s), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=30)
        cfg = BenchConfig(endpoint=f"http://127.0.0.1:{port}", concurrency=concurrency)
        work = [BenchRequest(i, 0.0, (1, 2, 3, 4), 4, tokens) for i in range(requests)]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        _, runs = run_bench(cfg, [(None, work)])
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        proc.terminate()
        proc.join()
    s = runs[0].summary
    events = sum(len(r.token_times_s) for r in runs[0].results)
    return {"interval_ms": interval_s * 1000, "requests": requests, "completed": s["completed"],
            "tokens": events, "concurrency": concurrency, "wall_s": round(wall, 3),
            "client_cpu_s": round(cpu, 3),
            "client_cpu_us_per_token": round(cpu / max(events, 1) * 1e6, 1),
            "client_cpu_ms_per_request": round(cpu / requests * 1e3, 2),
            "itl_mean_ms": round(s["itl_mean_s"]["mean"] * 1000, 3),
            "tbt_mean_ms": round(s["tbt_s"]["mean"] * 1000, 3),
            "ttft_p50_ms": round(s["ttft_s"]["p50"] * 1000, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    rows = [_measure(ns.requests, ns.tokens, ns.concurrency, 0.0),
            _measure(ns.requests, ns.tokens, ns.concurrency, ns.interval_ms / 1000)]
    if ns.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
