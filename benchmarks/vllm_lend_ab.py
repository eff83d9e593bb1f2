"""A/B of vLLM core lending (`integrations/vllm/lend.py`): a decode vLLM's step, lent vs pinned.

Starts a store and two vLLM-CPU servers with `YuebingConnector` lending over CPUs 0-1: P (own
CPU 0) and D (own CPU 1). In interleaved rounds it times D's decode step (median token gap of
--batch greedy streams, ignore_eos) while P is idle and while P prefills distinct prompts back
to back, each lent and "pinned": this process then holds a third ledger slot claiming one core,
so every step keeps to its own thread, as with --no-lend-cores. Also the CPU seconds per second
D's and P's processes used meanwhile (lent, P idle: about 2 for D; pinned: at most 1 each).
Prints one JSON object (medians, raw values).

Usage:  nice -n 19 env PYTHONPATH=src .venv/bin/python benchmarks/vllm_lend_ab.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from yuebing.instance.cores import CoreLedger
from yuebing.integrations.vllm.server import VllmEnv, VllmServer, VllmServerConfig
from yuebing.ops.priority import EnginePriority
from yuebing.store.benchprocs import start_master, start_node

VOCAB = 49152
TICK = os.sysconf("SC_CLK_TCK")


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB - 100) for _ in range(n)]


def complete(url: str, ids: list[int], max_tokens: int, text: list[str] | None = None
             ) -> list[float]:
    """Arrival times of a greedy stream's chunks (its text appended to ``text``)."""
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": ids, "stream": True,
                       "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            if raw.startswith(b"data:") and b"[DONE]" not in raw:
                chunk = json.loads(raw[5:])
                if "choices" not in chunk:
                    raise RuntimeError(f"{url}: {chunk}")
                times.append(time.perf_counter())
                if text is not None:
                    text.append(chunk["choices"][0].get("text", "") if chunk["choices"] else "")
    return times


def cpu_s(session: int) -> float:
    """CPU seconds used so far by the processes of a session (a vLLM server's group)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text()
        except OSError:
            continue
        rest = f[f.rindex(")") + 2:].split()
        if int(rest[3]) == session:
            total += int(rest[11]) + int(rest[12])
    return total / TICK


def thread_cpu_s(session: int) -> dict[int, float]:
    """CPU seconds so far of each thread of a session's processes."""
    out: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text()
            if int(f[f.rindex(")") + 2:].split()[3]) != session:
                continue
            for t in (d / "task").iterdir():
                r = (t / "stat").read_text()
                rest = r[r.rindex(")") + 2:].split()
                out[int(t.name)] = (int(rest[11]) + int(rest[12])) / TICK
        except (OSError, ValueError):
            continue
    return out


def decode_step(url: str, batch: int, tokens: int, rng: random.Random
                ) -> tuple[float, list[str]]:
    """Median token gap over ``batch`` concurrent streams, the first 3 tokens skipped, and
    the streams' texts."""
    texts: list[list[str]] = [[] for _ in range(batch)]
    prompts = [prompt(rng, 32) for _ in range(batch)]
    with ThreadPoolExecutor(batch) as ex:
        runs = list(ex.map(lambda i: complete(url, prompts[i], tokens, texts[i]), range(batch)))
    gaps = [b - a for t in runs for a, b in zip(t[3:], t[4:], strict=False)]
    return statistics.median(gaps), ["".join(t) for t in texts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--decode-tokens", type=int, default=40)
    ap.add_argument("--prefill-tokens", type=int, default=1500)
    ap.add_argument("--port", type=int, default=8931)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    env = VllmEnv()
    if why := env.missing():
        raise SystemExit(why)
    logs = Path(tempfile.mkdtemp(prefix="yb-lend-ab-"))
    master = start_master()
    node = start_node(master.info["address"], "1GiB")
    servers: dict[str, VllmServer] = {}
    try:
        for port, (role, cpu) in enumerate((("P", 0), ("D", 1)), args.port):
            cfg = VllmServerConfig(port=port, master=master.info["address"], dtype=args.dtype,
                                   threads=1, cpus=(cpu,), lend_cpus=(0, 1),
                                   priority=EnginePriority(nice=19))
            servers[role] = VllmServer(cfg, logs / f"{role}.log", env)
        for s in servers.values():
            s.wait_ready(1200)
        rng = random.Random(7)
        pin = CoreLedger(1, cores=2)
        for s in servers.values():  # warm each (first steps build kernels)
            decode_step(s.url, 2, 8, rng)
        out: dict[str, list[float]] = {}
        # per batch: streams whose greedy text was the same lent and pinned, of all compared
        texts_same: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for busy in (False, True):
                for batch in batches:
                    seed = rng.random()
                    said: dict[str, list[str]] = {}
                    for mode in ("lend", "pinned"):
                        p, d = servers["P"], servers["D"]
                        if mode == "pinned":
                            pin.acquire(borrow=False)
                            pin.release(idle=False)  # claims a core, uses none
                        stop = threading.Event()

                        def prefills(url: str = p.url, stop: threading.Event = stop) -> None:
                            r = random.Random()
                            while not stop.is_set():
                                complete(url, prompt(r, args.prefill_tokens), 1)

                        bg = threading.Thread(target=prefills, daemon=True)
                        if busy:
                            bg.start()
                            time.sleep(0.5)
                        t0 = thread_cpu_s(d.proc.pid)
                        c0 = (cpu_s(d.proc.pid), cpu_s(p.proc.pid), time.perf_counter())
                        step, said[mode] = decode_step(d.url, batch, args.decode_tokens,
                                                       random.Random(seed))
                        c1 = (cpu_s(d.proc.pid), cpu_s(p.proc.pid), time.perf_counter())
                        t1 = thread_cpu_s(d.proc.pid)
                        stop.set()
                        if busy:
                            bg.join()
                        pin.release(idle=True)
                        key = f"{mode} b{batch} {'prefilling' if busy else 'idle'}"
                        wall = c1[2] - c0[2]
                        out.setdefault(key + " step_ms", []).append(step * 1e3)
                        out.setdefault(key + " D_cpu", []).append((c1[0] - c0[0]) / wall)
                        out.setdefault(key + " P_cpu", []).append((c1[1] - c0[1]) / wall)
                        busy_threads = sorted((t1[t] - t0.get(t, 0.0)) / wall for t in t1)
                        out.setdefault(key + " D_2nd_busiest_thread_cpu", []).append(
                            busy_threads[-2] if len(busy_threads) > 1 else 0.0)
                    same = sum(a == b for a, b in zip(said["lend"], said["pinned"], strict=True))
                    texts_same.setdefault(f"b{batch}", [0, 0])
                    texts_same[f"b{batch}"][0] += same
                    texts_same[f"b{batch}"][1] += batch
        print(json.dumps({k: round(statistics.median(v), 2) for k, v in sorted(out.items())}
                         | {"raw": {k: [round(x, 2) for x in v] for k, v in out.items()},
                            "same_text_lent_vs_pinned": texts_same,
                            "logs": str(logs)}, indent=1))
        return 0
    finally:
        for s in servers.values():
            s.stop()
        node.stop()
        master.stop()


if __name__ == "__main__":
    raise SystemExit(main())
