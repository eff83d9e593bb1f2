"""One request at a time through `yuebing serve` with the real model (issue 13, Performance).

Starts ``yuebing serve --prefill 1 --decode 1`` (SmolLM2-135M-Instruct, ``--dtype``, one thread
per instance) on a free port, sends ``--requests`` streamed completions one after another
(distinct random prompts of ``--prompt-tokens`` token ids, so no prefix is reused;
``--max-tokens`` each, ``ignore_eos``), and reads each request's ``usage.yuebing`` breakdown and
the decode instance's own step time (its load report's ``decode_step_s``, from ``/health``).
Checks issue 13's two targets per request:

- TTFT within 10 % of the prefill instance's own prefill time (``prefill_s``) plus the policy's
  transfer estimate (``estimate.transfer_s``);
- TBT (the paper's: mean of the longest 10 % of the token intervals) within 15 % of the decode
  instance's step time.

It also prints the Conductor's estimates against what each request took (issue 25: the
estimated prefill of a 4,000-token prompt within ±25 % of the measured one). ``--defaults``
starts ``yuebing serve`` with no engine or topology flags at all (what a user gets: one coupled
instance on a host of fewer than 4 cores, else 1P1D) and an empty learned state (a first
start), and prints the predictors' ``/health`` state.

    .venv/bin/python benchmarks/serve_single.py [--json] [--dtype float32] [--requests 5]
    .venv/bin/python benchmarks/serve_single.py --defaults --prompt-tokens 4000 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

NAME = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def stream(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion; its usage (with the ``yuebing`` extension) and chunk times."""
    body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"content-type": "application/json"})
    from yuebing.bench.client import SSEParser

    t0, usage, sse = time.perf_counter(), None, SSEParser()
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            data = sse.feed(raw)
            if data is None or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None:
        raise RuntimeError("no usage chunk in the stream")
    return {"wall_s": time.perf_counter() - t0, **usage["yuebing"],
            "completion_tokens": usage["completion_tokens"]}


def decode_step(url: str, wait_s: float = 10.0) -> float:
    """The decode (or coupled) instance's step time from ``/health``. A load report can be a
    moment away from it (a report lost to a busy host, a resync), so this waits up to
    ``wait_s`` for one before it gives up with what ``/health`` holds."""
    end = time.monotonic() + wait_s
    while True:
        health = get(url + "/health")
        for name, load in health["load"].items():
            if name.startswith(("decode", "coupled")):
                return float(load["decode_step_s"])
        if time.monotonic() > end:
            raise RuntimeError(f"no decode instance's load in /health: {health['instances']}")
        time.sleep(0.2)  # a load report comes about every 0.1-0.5 s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--flags", default="", help="extra flags for `yuebing serve`")
    ap.add_argument("--defaults", action="store_true",
                    help="default `yuebing serve` (no --prefill/--decode/--threads/--dtype), "
                         "learned state in a fresh directory")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = Path(tempfile.mkdtemp(prefix="yb-serve-single-"))
    engine = ["--learned-dir", str(logs / "learned")] if ns.defaults else [
        "--prefill", "1", "--decode", "1", "--threads", "1", "--dtype", ns.dtype]
    cmd = [sys.executable, "-m", "yuebing.cli.main", "serve", *engine, "--port", str(port),
           "--log-dir", str(logs), "--restart", "never", *ns.flags.split()]
    proc = subprocess.Popen(cmd, stdout=(logs / "serve.out").open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    rows: list[dict[str, Any]] = []
    try:
        end = time.monotonic() + 600
        while True:
            try:
                if get(url + "/health")["ready"]:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"yuebing serve did not start; logs in {logs}")
            time.sleep(0.5)
        rng = random.Random(13)
        stream(url, [rng.randrange(100, 40000) for _ in range(64)], 8)  # warm-up
        for _ in range(ns.requests):
            prompt = [rng.randrange(100, 40000) for _ in range(ns.prompt_tokens)]
            r = stream(url, prompt, ns.max_tokens)
            r["decode_step_s"] = decode_step(url)
            r["ttft_vs_prefill_plus_transfer"] = r["ttft_s"] / (
                r["prefill_s"] + r["estimate"]["transfer_s"])
            r["tbt_vs_decode_step"] = r["tbt_s"] / r["decode_step_s"]
            r["est_vs_prefill"] = r["estimate"]["prefill_s"] / r["prefill_s"]
            r["est_vs_ttft"] = r["estimate"]["ttft_s"] / r["ttft_s"]
            rows.append(r)
        predictors = get(url + "/health").get("predictors", {})
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    med = {k: statistics.median(r[k] for r in rows) for k in (
        "ttft_s", "prefill_s", "tbt_s", "decode_step_s", "ttft_vs_prefill_plus_transfer",
        "tbt_vs_decode_step", "est_vs_prefill", "est_vs_ttft")}
    med["est_transfer_s"] = statistics.median(r["estimate"]["transfer_s"] for r in rows)
    result = {"setup": {"dtype": "(default)" if ns.defaults else ns.dtype, "requests": ns.requests,
                        "prompt_tokens": ns.prompt_tokens, "max_tokens": ns.max_tokens,
                        "flags": ns.flags, "defaults": ns.defaults,
                        "loadavg": os.getloadavg()[0]},
              "median": med, "predictors": {k: predictors.get(k) for k in (
                  "prefill_scale", "prefill_lent")}, "requests": rows,
              "ttft_within_10pct": all(abs(r["ttft_vs_prefill_plus_transfer"] - 1) <= 0.10
                                       for r in rows),
              "tbt_within_15pct": all(abs(r["tbt_vs_decode_step"] - 1) <= 0.15 for r in rows)}
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        for r in rows:
            print(f"ttft {r['ttft_s'] * 1e3:8.1f} ms = prefill {r['prefill_s'] * 1e3:8.1f} + "
                  f"est. transfer {r['estimate']['transfer_s'] * 1e3:6.1f} -> ratio "
                  f"{r['ttft_vs_prefill_plus_transfer']:.3f};  tbt {r['tbt_s'] * 1e3:6.1f} ms "
                  f"vs decode step {r['decode_step_s'] * 1e3:6.1f} ms -> "
                  f"{r['tbt_vs_decode_step']:.3f};  Conductor estimate / measured: prefill "
                  f"{r['est_vs_prefill']:.2f}, TTFT {r['est_vs_ttft']:.2f}")
        print(f"predictors: {result['predictors']}")
        print(f"TTFT within 10 %: {result['ttft_within_10pct']}; "
              f"TBT within 15 %: {result['tbt_within_15pct']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
