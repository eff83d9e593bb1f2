"""Store hit across vLLM instances (issue 31): vLLM instance A prefills a prompt and its
`YuebingConnector` saves the prompt's full store blocks to a yuebing store; instance B, started
after A has stopped (it never saw the prompt), loads them from the store.

Steps: a store master and one node (1 GiB DRAM) on loopback; each server first answers a short
warm-up prompt (not timed); A answers prompt P (``--tokens``
random token ids, greedy, ``--max-tokens``) and stops; B answers a cold prompt Q of the same
length (its cold TTFT: nothing of Q is stored), then P (TTFT with the store hit). Prints JSON:
both TTFTs, their ratio (target <= 0.3 at 4,000 tokens), whether B's output on P equals A's,
the vLLM flags. vLLM runs from the peers venv (benchmarks/peers/install_vllm_cpu.sh).

Usage:  PYTHONPATH=src .venv/bin/python benchmarks/vllm_store_hit.py [--tokens 4000]
        [--max-tokens 16] [--port 8790] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from yuebing.integrations.vllm.server import (
    VllmEnv,
    VllmServer,
    VllmServerConfig,
    stream_completion,
)
from yuebing.store.benchprocs import start_master, start_node

VOCAB = 49152


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB - 100) for _ in range(n)]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(tokens: int, max_tokens: int, port: int, logs: Path) -> dict[str, object]:
    env = VllmEnv()
    why = env.missing()
    if why:
        raise SystemExit(why)
    master = start_master()
    node = None
    try:
        node = start_node(master.info["address"], "1GiB")
        cfg = VllmServerConfig(port=port, master=master.info["address"],
                               max_model_len=max(4352, tokens + max_tokens + 64))
        p, q = prompt(1, tokens), prompt(2, tokens)
        out: dict[str, object] = {"tokens": tokens, "max_tokens": max_tokens,
                                  "argv": cfg.argv(env)[1:], "loadavg_start": loadavg()}
        t0 = time.monotonic()
        with VllmServer(cfg, logs / "vllm_a.log", env) as a:
            a.wait_ready()
            out["a_start_s"] = round(time.monotonic() - t0, 1)
            stream_completion(a.url, cfg.served_name, prompt(3, 32), 2)
            ttft_a, text_a = stream_completion(a.url, cfg.served_name, p, max_tokens)
        time.sleep(1.0)  # A's saves are put off the step's path; A's stop drained them
        with VllmServer(cfg, logs / "vllm_b.log", env) as b:
            b.wait_ready()
            stream_completion(b.url, cfg.served_name, prompt(3, 32), 2)
            ttft_cold, _ = stream_completion(b.url, cfg.served_name, q, max_tokens)
            ttft_hit, text_b = stream_completion(b.url, cfg.served_name, p, max_tokens)
        out.update({"a_ttft_s": round(ttft_a, 3), "b_cold_ttft_s": round(ttft_cold, 3),
                    "b_hit_ttft_s": round(ttft_hit, 3),
                    "hit_over_cold": round(ttft_hit / ttft_cold, 3),
                    "output_identical": text_a == text_b, "a_text": text_a, "b_text": text_b,
                    "loadavg_end": loadavg(),
                    "b_log_hits": (logs / "vllm_b.log").read_text(errors="replace").count(
                        "yuebing store hit")})
        return out
    finally:
        if node is not None:
            node.stop()
        master.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--logs", type=Path, default=None)
    ns = ap.parse_args()
    logs = ns.logs or Path(tempfile.mkdtemp(prefix="yb-vllm-hit-"))
    logs.mkdir(parents=True, exist_ok=True)
    out = run(ns.tokens, ns.max_tokens, ns.port, logs)
    out["logs"] = str(logs)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
