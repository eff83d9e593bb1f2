"""Benchmark: the maximum rate at the TTFT SLO with chunked pipeline parallel prefill and without
(issue 27's target: long-context workload, CPP >= 1.5x, short prompts mixed in keep their
attainment).

The same trace, long prompts (``yuebing trace synth fixed --input-tokens 8000``) with a share
``--short-share`` of short ones (``--short-tokens``) mixed in, is replayed by ``yuebing bench
serve`` at each of ``--rates`` (Poisson arrivals, ascending; a system stops at its first rate
below ``--target`` attainment) against two fresh clusters, one engine thread per instance:

- ``cpp``:   ``yuebing serve --prefill 2 --cpp-group 2`` (one group of two stages, a
  whole-model twin beside each for short prompts);
- ``plain``: ``yuebing serve --prefill 2`` (two single prefill instances).

Reported per system and rate: TTFT attainment of all requests, of the long and of the short
ones, TTFT p50/p90 of each, where the short prompts were prefilled; per system the maximum rate
at >= ``--target`` attainment, and the ratio cpp / plain. Writes ``OUTDIR/cpp_rate.json`` and
``OUTDIR/cpp_rate.png`` (attainment against rate).

    nice -n 5 .venv/bin/python benchmarks/cpp_rate.py OUTDIR    # ~13 min on SmolLM2, 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from yuebing.ops.procs import ReadyProcess
from yuebing.trace.latency import nearest_rank

ROOT = Path(__file__).resolve().parent.parent
YB = str(ROOT / ".venv" / "bin" / "yuebing")
ACCESS = re.compile(r" status=200 prefill=(\S+) decode=\S+ prompt=(\d+) ")
SYSTEMS = {"cpp": ("--prefill", "2", "--cpp-group", "2"), "plain": ("--prefill", "2")}


def positive_floats(text: str) -> list[float]:
    try:
        vals = sorted(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         "numbers") from None
    if not vals or any(not (math.isfinite(v) and v > 0) for v in vals):
        raise argparse.ArgumentTypeError(f"every rate must be a positive number, got {text!r}")
    return vals


def make_trace(args: argparse.Namespace, out: Path) -> Path:
    """Long and short requests interleaved (every ``1/short_share``-th a short one), their
    hash blocks apart (no prefix shared between them; ``--shared-fraction 0``)."""
    n_short = round(args.requests * args.short_share)
    n_long = args.requests - n_short
    rows: list[dict[str, Any]] = []
    for kind, n, tokens, seed in (("long", n_long, args.long_tokens, 1),
                                  ("short", n_short, args.short_tokens, 2)):
        if not n:
            continue
        path = out / f"{kind}.jsonl"
        subprocess.run([args.yuebing, "trace", "synth", "fixed", "--out", str(path), "--requests",
                        str(n), "--input-tokens", str(tokens), "--output-tokens",
                        str(args.output_tokens), "--shared-fraction", "0", "--seed", str(seed)],
                       check=True, capture_output=True)
        batch = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for r in batch:
            r["hash_ids"] = [h + seed * 10**9 for h in r["hash_ids"]]
        rows.append({"kind": kind, "rows": batch})
    longs = next((b["rows"] for b in rows if b["kind"] == "long"), [])
    shorts = next((b["rows"] for b in rows if b["kind"] == "short"), [])
    mixed: list[dict[str, Any]] = []
    every = max(1, round(args.requests / n_short)) if n_short else 0
    for i in range(args.requests):  # order only: bench serve draws the arrival times
        pick = shorts if (every and i % every == every - 1 and shorts) or not longs else longs
        r = pick.pop(0)
        r["timestamp"] = i
        mixed.append(r)
    trace = out / "mixed.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    return trace


def start(system: str, args: argparse.Namespace, logs: Path) -> ReadyProcess:
    logs.mkdir(parents=True, exist_ok=True)
    argv = [args.yuebing, "-v", "serve", *SYSTEMS[system], "--decode", "1", "--threads", "1",
            "--port", str(args.port), "--log-dir", str(logs), "--restart", "never",
            "--ttft-slo-s", f"{args.ttft_slo_s:g}", *args.serve_flag]
    return ReadyProcess(argv, name="serve", workdir=logs, timeout_s=900, stop_s=60)


def run_rate(trace: Path, rate: float, args: argparse.Namespace, name: str,
             prompt_seed: int) -> dict[str, Any]:
    """One rate on a running cluster; ``prompt_seed``: other prompts than the other rates'
    (the same trace again would hit the prefix caches of the rate before)."""
    records = args.out / f"{name}.records.jsonl"
    argv = [args.yuebing, "bench", "serve", str(trace), "--endpoint", f"http://127.0.0.1:{args.port}",
            "--rate", f"{rate:g}", "--seed", str(args.seed), "--slo-ttft",
            f"{args.ttft_slo_s:g}", "--prompt-seed", str(prompt_seed), "--timeout-s", f"{args.timeout_s:g}", "--records",
            str(records), "--no-progress", "--json", *args.bench_flag]
    t0 = time.monotonic()
    bench = subprocess.run(argv, capture_output=True)
    if bench.returncode != 0:
        raise RuntimeError(f"yuebing bench serve failed ({bench.returncode}): "
                           f"{bench.stderr.decode(errors='replace')[-1000:]}")
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    out: dict[str, Any] = {"rate": rate, "wall_s": time.monotonic() - t0}
    for kind, pick in (("all", rows),
                       ("long", [r for r in rows if r["input_tokens"] > args.short_tokens]),
                       ("short", [r for r in rows if r["input_tokens"] <= args.short_tokens])):
        ttft = sorted(r["ttft_s"] for r in pick if r["status"] == "ok")
        ok = sum(1 for t in ttft if t <= args.ttft_slo_s)
        out[kind] = {"requests": len(pick), "answered": len(ttft),
                     "errors": sorted({str(r.get("error")) for r in pick if r["status"] == "error"}),
                     "attainment": ok / len(pick) if pick else None,
                     "ttft_p50_s": nearest_rank(ttft, 0.5) if ttft else None,
                     "ttft_p90_s": nearest_rank(ttft, 0.9) if ttft else None}
    return out


def prefill_instances(logs: Path, short_tokens: int) -> dict[str, int]:
    """Where the Conductor prefilled the short prompts (its access log's ``prefill=`` field)."""
    where: dict[str, int] = {}
    for line in (logs / "conductor.log").read_text(errors="replace").splitlines():
        m = ACCESS.search(line)
        if m and int(m[2]) <= short_tokens:
            where[m[1]] = where.get(m[1], 0) + 1
    return where


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for system, color in (("cpp", "tab:blue"), ("plain", "tab:orange")):
        runs = result["systems"][system]["runs"]
        rates = [r["rate"] for r in runs]
        for kind, style in (("all", "-o"), ("short", "--^")):
            ys = [r[kind]["attainment"] for r in runs]
            ax.plot(rates, [y if y is not None else float("nan") for y in ys], style,
                    color=color, label=f"{system} ({kind})")
    ax.axhline(result["target"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("request rate (1/s)")
    ax.set_ylabel(f"TTFT attainment (SLO {result['ttft_slo_s']:g} s)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rates", type=positive_floats, default=[0.06, 0.1, 0.15])
    ap.add_argument("--requests", type=int, default=8, help="requests per rate")
    ap.add_argument("--short-share", type=float, default=0.25)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--short-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--ttft-slo-s", type=float, default=30.0)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--systems", default="cpp,plain")
    ap.add_argument("--yuebing", default=YB, help="the yuebing command (default: the repo's)")
    ap.add_argument("--serve-flag", action="append", default=[],
                    help="one more flag for both `yuebing serve`s (repeatable), e.g. "
                         "--serve-flag=--model=dummy:preset=tiny")
    ap.add_argument("--bench-flag", action="append", default=[],
                    help="one more flag for `yuebing bench serve` (repeatable)")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        ap.error(f"--systems: choose from {', '.join(SYSTEMS)}, got {args.systems!r}")
    if args.requests < 1 or not 0 <= args.short_share < 1 or args.short_tokens < 1 \
            or args.long_tokens <= args.short_tokens or not 0 < args.target <= 1:
        ap.error("--requests must be >= 1, --short-share in [0, 1), --long-tokens above "
                 "--short-tokens >= 1, --target in (0, 1]")
    args.out.mkdir(parents=True, exist_ok=True)
    trace = make_trace(args, args.out)
    result: dict[str, Any] = {"rates": args.rates, "target": args.target,
                              "ttft_slo_s": args.ttft_slo_s, "requests": args.requests,
                              "short_share": args.short_share, "long_tokens": args.long_tokens,
                              "short_tokens": args.short_tokens, "systems": {}}
    for system in systems:
        logs = args.out / "logs" / system
        runs: list[dict[str, Any]] = []
        proc = start(system, args, logs)
        try:
            for k, rate in enumerate(args.rates):
                run = run_rate(trace, rate, args, f"{system}-{rate:g}", 1000 + k)
                runs.append(run)
                print(f"{system} rate {rate:g}/s: attainment all {run['all']['attainment']}, "
                      f"short {run['short']['attainment']} ({run['wall_s']:.0f} s)",
                      file=sys.stderr)
                if (run["all"]["attainment"] or 0.0) < args.target:
                    break  # higher rates only queue more
        finally:
            proc.stop()
        ok = [r["rate"] for r in runs if (r["all"]["attainment"] or 0.0) >= args.target]
        result["systems"][system] = {"runs": runs, "max_rate": max(ok) if ok else None,
                                     "short_prefilled_on": prefill_instances(
                                         logs, args.short_tokens)}
    rates = {s: v["max_rate"] for s, v in result["systems"].items()}
    if rates.get("cpp") and rates.get("plain"):
        result["max_rate_ratio"] = rates["cpp"] / rates["plain"]
    (args.out / "cpp_rate.json").write_text(json.dumps(result, indent=1))
    if set(systems) == set(SYSTEMS):
        plot(result, args.out / "cpp_rate.png")
    print(json.dumps({"max_rate": rates, "max_rate_ratio": result.get("max_rate_ratio"),
                      "short_attainment": {s: [r["short"]["attainment"] for r in v["runs"]]
                                           for s, v in result["systems"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
