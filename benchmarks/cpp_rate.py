"""Benchmark: the maximum rate at TTFT SLOs with chunked pipeline parallel prefill and without
(issue 27: long-context workload, CPP >= 1.5x, short prompts mixed in keep their attainment).

A trace of long prompts (``yuebing trace synth fixed --input-tokens 8000``) with a share
``--short-share`` of short ones mixed in is replayed by ``yuebing bench serve`` (Poisson
arrivals) at each of ``--rates``, ascending, against two fresh clusters, one engine thread per
instance: ``cpp`` = ``yuebing serve --prefill 2 --cpp-group 2`` (a group of two stages, a
whole-model twin beside each), ``plain`` = ``--prefill 2``. By default both run as
`cpp_ttft.py` does (no lent cores, kernels pinned: the profile's conditions); ``--serve-defaults``
runs serve's defaults. Every request's TTFT is kept, so one run per rate gives the attainment at
each of ``--slos``: per SLO and system the maximum rate (the last rate before the first one below
``--target``) and the ratio cpp / plain. A system stops at its first rate below target at the
largest SLO. ``--sim-profile`` adds the simulator's curve (same mix, same profile, many
requests). Prints the expected duration first, progress per rate; writes ``OUTDIR/cpp_rate.json``,
``OUTDIR/cpp_rate.png`` (max rate vs SLO, attainment vs rate) and a markdown table on stdout.

    nice -n 5 .venv/bin/python benchmarks/cpp_rate.py OUTDIR --sim-profile P   # ~36 min, 2 cores
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


PINNED = ("--no-lend-cores", "--attention", "paged", "--prefill-attention", "sdpa")
"""`cpp_ttft.py`'s conditions: each instance on its own thread (no idle neighbour's core lent to
a single instance, which would give it the group's two cores at low load) and the same kernels
in every process (those of `yuebing profile --threads 1 --attention paged --prefill-attention
sdpa`, so the simulator's profile matches)."""


def start(system: str, args: argparse.Namespace, logs: Path) -> ReadyProcess:
    logs.mkdir(parents=True, exist_ok=True)
    argv = [args.yuebing, "-v", "serve", *SYSTEMS[system], "--decode", "1", "--threads", "1",
            "--port", str(args.port), "--log-dir", str(logs), "--restart", "never",
            "--ttft-slo-s", f"{args.ttft_slo_s:g}", *(() if args.serve_defaults else PINNED),
            *args.serve_flag]
    return ReadyProcess(argv, name="serve", workdir=logs, timeout_s=900, stop_s=60)


def summarize(rows: list[dict[str, Any]], short_tokens: int,
              slos: list[float]) -> dict[str, Any]:
    """Per kind (all, long, short): requests, answered, errors, TTFT p50/p90 and the attainment
    at each SLO (share of all the kind's requests answered within it)."""
    out: dict[str, Any] = {}
    for kind, pick in (("all", rows),
                       ("long", [r for r in rows if r["input_tokens"] > short_tokens]),
                       ("short", [r for r in rows if r["input_tokens"] <= short_tokens])):
        ttft = sorted(r["ttft_s"] for r in pick if r["status"] == "ok")
        out[kind] = {"requests": len(pick), "answered": len(ttft),
                     "errors": sorted({str(r.get("error")) for r in pick
                                       if r["status"] == "error"}),
                     "attainment": {f"{s:g}": (sum(1 for t in ttft if t <= s) / len(pick)
                                               if pick else None) for s in slos},
                     "ttft_p50_s": nearest_rank(ttft, 0.5) if ttft else None,
                     "ttft_p90_s": nearest_rank(ttft, 0.9) if ttft else None}
    return out


def max_rates(runs: list[dict[str, Any]], slos: list[float], target: float,
              kind: str = "all") -> dict[str, float | None]:
    """Per SLO, the last rate (ascending) before the first one whose attainment is below
    ``target`` (a lucky pass above a miss does not count); None when the first rate misses."""
    out: dict[str, float | None] = {}
    for s in slos:
        best = None
        for run in sorted(runs, key=lambda r: r["rate"]):
            a = run[kind]["attainment"][f"{s:g}"]
            if a is None or a < target:
                break
            best = run["rate"]
        out[f"{s:g}"] = best
    return out


def ratios(cpp: dict[str, float | None], plain: dict[str, float | None]) -> dict[str, Any]:
    """cpp / plain per SLO: a number, "plain: none" when only cpp passed a rate (the ratio is
    above cpp's max over the lowest rate tried), or None when cpp passed none."""
    out: dict[str, Any] = {}
    for s, c in cpp.items():
        p = plain.get(s)
        out[s] = None if c is None else round(c / p, 3) if p else "plain: none"
    return out


def expected_s(args: argparse.Namespace, systems: list[str]) -> float:
    """Seconds if every rate runs: per system its start-up, then per rate the arrivals
    (requests / rate) and the drain after the last one."""
    per = sum(args.requests / r + args.drain_s for r in args.rates)
    return len(systems) * (args.startup_s + per)


def run_rate(trace: Path, rate: float, args: argparse.Namespace, name: str,
             prompt_seed: int, tick: Any) -> dict[str, Any]:
    """One rate on a running cluster; ``prompt_seed``: other prompts than the other rates'
    (the same trace again would hit the prefix caches of the rate before)."""
    records = args.out / f"{name}.records.jsonl"
    argv = [args.yuebing, "bench", "serve", str(trace), "--endpoint",
            f"http://127.0.0.1:{args.port}", "--rate", f"{rate:g}", "--seed", str(args.seed),
            "--slo-ttft", f"{args.ttft_slo_s:g}", "--prompt-seed", str(prompt_seed),
            "--timeout-s", f"{args.timeout_s:g}", "--records", str(records), "--no-progress",
            "--json", *args.bench_flag]
    t0 = time.monotonic()
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as bench:
        while True:
            try:
                _, err = bench.communicate(timeout=60)
                break
            except subprocess.TimeoutExpired:
                tick(time.monotonic() - t0)
    if bench.returncode != 0:
        raise RuntimeError(f"yuebing bench serve failed ({bench.returncode}): "
                           f"{err.decode(errors='replace')[-1000:]}")
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    return {"rate": rate, "wall_s": time.monotonic() - t0,
            **summarize(rows, args.short_tokens, args.slos)}


def prefill_instances(logs: Path, short_tokens: int) -> dict[str, int]:
    """Where the Conductor prefilled the short prompts (its access log's ``prefill=`` field)."""
    where: dict[str, int] = {}
    for line in (logs / "conductor.log").read_text(errors="replace").splitlines():
        m = ACCESS.search(line)
        if m and int(m[2]) <= short_tokens:
            where[m[1]] = where.get(m[1], 0) + 1
    return where


def simulated(args: argparse.Namespace) -> dict[str, Any]:
    """The simulator's runs of both systems on the same mix (``--sim-requests`` per rate and
    seed, ``--sim-seeds`` seeds pooled) with the cost model fitted from ``--sim-profile``, on
    a fine grid of rates: per system the same summaries and maximum rates as the live ones."""
    import random
    from dataclasses import replace

    from yuebing.sim.hardware import FittedCostModel
    from yuebing.sim.runner import simulate
    from yuebing.sim.system import SimConfig, sim_policy
    from yuebing.sim.workload import SimRequest

    cost = FittedCostModel.from_file(args.sim_profile)
    chunk = cost.prefill_chunk_tokens
    bt = 16
    policy = sim_policy(block_tokens=bt, cpp_threshold_tokens=chunk, cpp_chunk_tokens=chunk,
                        cpp_boundary_bytes_per_token=args.boundary_bytes,
                        ttft_slo_s=args.ttft_slo_s)
    configs = {"cpp": SimConfig(prefill_nodes=0, decode_nodes=1, cpp_groups=1, cpp_twins=True,
                                policy=policy, output_tokens=args.output_tokens),
               "plain": SimConfig(prefill_nodes=2, decode_nodes=1, output_tokens=args.output_tokens,
                                  policy=replace(policy, cpp_max_nodes=1))}
    long_s, short_s = (cost.prefill_time(n, 0) for n in (args.long_tokens, args.short_tokens))
    top = 1.2 * 2 / ((1 - args.short_share) * long_s + args.short_share * short_s)  # plain's
    grid = [round(top * i / 30, 4) for i in range(1, 31)]  # capacity, 2 nodes, and 20 % more
    every = max(1, round(1 / args.short_share)) if args.short_share else 0
    out: dict[str, Any] = {"rates": grid, "requests": args.sim_requests, "seeds": args.sim_seeds,
                           "systems": {}}
    key = 0
    for system, cfg in configs.items():
        runs = []
        for rate in grid:
            rows = []
            for seed in range(args.sim_seeds):
                rng, t, reqs = random.Random(seed), 0.0, []
                for i in range(args.sim_requests):
                    t += rng.expovariate(rate)
                    n = args.short_tokens if every and i % every == every - 1 else args.long_tokens
                    reqs.append(SimRequest(i, t, n, args.output_tokens,
                                           tuple(range(key, key + -(-n // bt)))))
                    key += -(-n // bt)
                for r in simulate(reqs, cfg, cost=cost).records:
                    ok = r.rejected is None and not math.isnan(r.first_token_s)
                    rows.append({"input_tokens": r.input_tokens, "status": "ok" if ok else "error",
                                 "ttft_s": r.ttft_s, "error": r.reject_reason})
            runs.append({"rate": rate, **summarize(rows, args.short_tokens, args.slos)})
        out["systems"][system] = {"runs": runs,
                                  "max_rate": max_rates(runs, args.slos, args.target)}
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.0))
    slos = result["slos"]
    sim = result.get("sim", {}).get("systems", {})
    colors = {"cpp": "tab:blue", "plain": "tab:orange"}
    for system, color in colors.items():
        if system not in result["systems"]:
            continue
        m = result["systems"][system]["max_rate"]
        ax.plot(slos, [m[f"{s:g}"] or 0.0 for s in slos], "-o", color=color,
                label=f"{system} (live)")
        if system in sim:
            ms = sim[system]["max_rate"]
            ax.plot(slos, [ms[f"{s:g}"] or 0.0 for s in slos], ":", color=color,
                    label=f"{system} (simulated)")
        runs = result["systems"][system]["runs"]
        slo = f"{result['ttft_slo_s']:g}"
        for kind, style in (("all", "-o"), ("short", "--^")):
            ys = [r[kind]["attainment"].get(slo) for r in runs]
            bx.plot([r["rate"] for r in runs], [y if y is not None else float("nan") for y in ys],
                    style, color=color, label=f"{system} ({kind})")
    ratio = result.get("max_rate_ratio", {})
    tx = ax.twinx()
    ys = [v if isinstance(v, float) else float("nan") for v in (ratio.get(f"{s:g}") for s in slos)]
    tx.plot(slos, ys, "s--", color="grey", label="cpp / plain")
    tx.set_ylim(0, max([2.0, *(1.1 * y for y in ys if y == y)]))
    tx.axhline(1.5, color="grey", lw=0.6, ls=":")
    tx.set_ylabel("cpp / plain (target 1.5)")
    ax.set_xlabel("TTFT SLO (s)")
    ax.set_ylabel(f"max rate at {result['target']:.0%} attainment (1/s)")
    ax.legend(fontsize=7, loc="upper left")
    bx.axhline(result["target"], color="grey", lw=0.8, ls=":")
    bx.set_xlabel("request rate (1/s)")
    bx.set_ylabel(f"TTFT attainment (SLO {result['ttft_slo_s']:g} s)")
    bx.set_ylim(0, 1.05)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(result: dict[str, Any]) -> str:
    sim = result.get("sim", {}).get("systems", {})
    head = "| TTFT SLO (s) | cpp max rate | plain max rate | cpp / plain |"
    rows = [head + (" simulated cpp / plain |" if sim else ""),
            "|---|---|---|---|" + ("---|" if sim else "")]
    systems = result["systems"]
    for s in result["slos"]:
        k = f"{s:g}"
        c, p = (systems.get(n, {}).get("max_rate", {}).get(k) for n in ("cpp", "plain"))
        line = f"| {k} | {c} | {p} | {result.get('max_rate_ratio', {}).get(k)} |"
        if sim:
            line += f" {sim['cpp']['max_rate'][k]} / {sim['plain']['max_rate'][k]} |"
        rows.append(line)
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rates", type=positive_floats, default=[0.04, 0.055, 0.07])
    ap.add_argument("--requests", type=int, default=16, help="requests per rate")
    ap.add_argument("--slos", type=positive_floats, default=[20.0, 25.0, 30.0, 40.0],
                    help="TTFT SLOs (s) the attainment is computed at, from the same runs")
    ap.add_argument("--short-share", type=float, default=0.25)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--short-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--ttft-slo-s", type=float, default=30.0,
                    help="the Conductor's TTFT SLO (its routing and queue order)")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--systems", default="cpp,plain")
    ap.add_argument("--serve-defaults", action="store_true",
                    help="run serve's defaults (lent cores, kernels chosen at start) instead of "
                         "cpp_ttft.py's conditions")
    ap.add_argument("--startup-s", type=float, default=60.0,
                    help="a cluster's start-up, for the expected duration")
    ap.add_argument("--drain-s", type=float, default=30.0,
                    help="seconds after a rate's last arrival, for the expected duration")
    ap.add_argument("--sim-profile", default="",
                    help="`yuebing profile` predictors of the instances' engine: add the "
                         "simulator's curve (e.g. --threads 1 --attention paged "
                         "--prefill-attention sdpa)")
    ap.add_argument("--sim-only", action="store_true",
                    help="only the simulator's curve (seconds; needs --sim-profile)")
    ap.add_argument("--sim-requests", type=int, default=100)
    ap.add_argument("--sim-seeds", type=int, default=4)
    ap.add_argument("--boundary-bytes", type=int, default=2 * 576 * 2,
                    help="boundary bytes per token for the simulated group (SmolLM2)")
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
            or args.long_tokens <= args.short_tokens or not 0 < args.target <= 1 \
            or args.sim_requests < 1 or args.sim_seeds < 1:
        ap.error("--requests, --sim-requests and --sim-seeds must be >= 1, --short-share in "
                 "[0, 1), --long-tokens above --short-tokens >= 1, --target in (0, 1]")
    if args.sim_only and not args.sim_profile:
        ap.error("--sim-only needs --sim-profile")
    if args.sim_only:
        systems = []
    args.out.mkdir(parents=True, exist_ok=True)
    total = expected_s(args, systems)
    began = time.monotonic()
    print(f"expected duration: about {total / 60:.0f} min if every rate runs ({len(systems)} "
          f"systems x ({args.startup_s:g} s start-up + {len(args.rates)} rates x "
          f"{args.requests} requests)); a system stops at its first rate below target at the "
          f"largest SLO", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"rates": args.rates, "target": args.target, "slos": args.slos,
                              "ttft_slo_s": args.ttft_slo_s, "requests": args.requests,
                              "short_share": args.short_share, "long_tokens": args.long_tokens,
                              "short_tokens": args.short_tokens,
                              "conditions": "serve defaults" if args.serve_defaults else
                              " ".join(PINNED), "systems": {}}
    if args.sim_profile:
        result["sim"] = simulated(args)
        print(f"simulated: max rate per SLO {json.dumps({s: v['max_rate'] for s, v in result['sim']['systems'].items()})}",
              file=sys.stderr, flush=True)
    if args.sim_only:
        sim = result["sim"]["systems"]
        (args.out / "cpp_rate_sim.json").write_text(json.dumps(result, indent=1))
        print(table({**result, "sim": {}, "systems": sim, "max_rate_ratio": ratios(
            sim["cpp"]["max_rate"], sim["plain"]["max_rate"])}))
        return 0
    trace = make_trace(args, args.out)
    left = total
    for system in systems:
        logs = args.out / "logs" / system
        runs: list[dict[str, Any]] = []
        proc = start(system, args, logs)
        left -= args.startup_s
        try:
            for k, rate in enumerate(args.rates):
                planned = args.requests / rate + args.drain_s

                def tick(s: float, system: str = system, rate: float = rate,
                         planned: float = planned) -> None:
                    print(f"  {system} rate {rate:g}/s: {s:.0f} of ~{planned:.0f} s", file=sys.stderr,
                          flush=True)
                print(f"[{(time.monotonic() - began) / 60:.1f} min, ~{left / 60:.0f} min left] "
                      f"{system} rate {rate:g}/s: {args.requests} requests", file=sys.stderr,
                      flush=True)
                run = run_rate(trace, rate, args, f"{system}-{rate:g}", 1000 + k, tick)
                runs.append(run)
                left -= planned
                att = run["all"]["attainment"]
                print(f"{system} rate {rate:g}/s: attainment per SLO {att}, short "
                      f"{run['short']['attainment']} ({run['wall_s']:.0f} s)", file=sys.stderr,
                      flush=True)
                if (att[f"{max(args.slos):g}"] or 0.0) < args.target:
                    left -= sum(args.requests / r + args.drain_s for r in args.rates[k + 1:])
                    break  # higher rates only queue more
        finally:
            proc.stop()
        result["systems"][system] = {
            "runs": runs, "max_rate": max_rates(runs, args.slos, args.target),
            "max_rate_short": max_rates(runs, args.slos, args.target, "short"),
            "short_prefilled_on": prefill_instances(logs, args.short_tokens)}
    if {"cpp", "plain"} <= set(result["systems"]):
        result["max_rate_ratio"] = ratios(result["systems"]["cpp"]["max_rate"],
                                          result["systems"]["plain"]["max_rate"])
    result["wall_s"] = round(time.monotonic() - began, 1)
    (args.out / "cpp_rate.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "cpp_rate.png")
    print(table(result))
    print(json.dumps({"max_rate": {s: v["max_rate"] for s, v in result["systems"].items()},
                      "max_rate_ratio": result.get("max_rate_ratio"),
                      "short_attainment": {s: [r["short"]["attainment"] for r in v["runs"]]
                                           for s, v in result["systems"].items()},
                      "wall_s": result["wall_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
