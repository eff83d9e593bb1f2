"""Prefill queue orders in the simulator (issue 25): 1P1D on one host, FIFO vs SLO-aware orders.

The workload is the serving head to head's (`benchmarks/serve_vs_vllm.sh`): the first ``--limit``
requests of the conversation trace, 64 tokens per hash block, input ≤ 4,096, output ≤
``--max-output`` (128, as the head to head; its ``MAX_OUTPUT``), Poisson arrivals — the load
generator's own requests (`sim_vs_live.workload`), one arrival seed per repeat. Each is replayed by
`yuebing.sim.runner.simulate` as `benchmarks/sim_vs_live.py` does: ``system=mooncake``, 1 prefill +
1 decode node on one host (``colocated`` with the interference factors of a ``yuebing profile
--interference`` samples file; ``--no-colocated``: each alone), ``cost_model=fitted`` on its
predictor file, and each ``--orders`` entry as the prefill queue order (``name`` or
``sjf_aging:AGING``).

Per order and rate: SLO attainment (TTFT ≤ ``--ttft-slo``, TBT ≤ ``--tbt-slo`` over all
requests; mean and lowest over the seeds), TTFT p50/p90 and the longest TTFT; per order the
maximum rate of the grid whose mean attainment is ≥ ``--target`` (and every lower rate's too).
Writes ``OUTDIR/prefill_queue.json``, ``prefill_queue.md`` (the table) and ``prefill_queue.png``;
prints the table.

Usage:
    .venv/bin/python benchmarks/prefill_queue.py OUTDIR --profile PREDICTORS.json \
        --interference SAMPLES.json --rates 0.1,0.15,0.2,0.25,0.3 --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_vs_live import TRACE, pct, workload  # noqa: E402

from yuebing.conductor.policy import (  # noqa: E402
    BivariatePolynomial,
    DecodePredictor,
    save_predictors,
)
from yuebing.sim.hardware import FittedCostModel  # noqa: E402
from yuebing.sim.runner import simulate  # noqa: E402
from yuebing.sim.system import SimConfig, sim_policy  # noqa: E402


def parse_order(spec: str) -> tuple[str, float | None]:
    """``name`` or ``name:aging``."""
    name, _, aging = spec.partition(":")
    return name, float(aging) if aging else None


def run_one(requests: list[Any], profile: Path, interference: Path | None, order: str,
            aging: float | None, ttft_slo: float, tbt_slo: float) -> dict[str, float]:
    """One simulated 1P1D run (``interference`` None: the nodes do not slow each other)."""
    extra = {} if aging is None else {"prefill_queue_aging": aging}
    cfg = SimConfig(system="mooncake", prefill_nodes=1, decode_nodes=1, cost_model="fitted",
                    profile=str(profile), sample_interval_s=1.0,
                    policy=sim_policy(block_tokens=64, ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo,
                                      cpp_threshold_tokens=1 << 30, prefill_queue=order, **extra),
                    colocated=interference is not None,
                    interference_profile=str(interference or ""),
                    )
    res = simulate(requests, cfg)
    done = [r for r in res.records if r.rejected is None and not math.isnan(r.finish_s)]
    ttft = [r.first_token_s - r.arrival_s for r in done]
    met = sum(1 for r, t in zip(done, ttft, strict=True) if t <= ttft_slo and r.tbt_s <= tbt_slo)
    return {"attainment": met / len(res.records), "ttft_p50": pct(ttft, 0.5),
            "ttft_p90": pct(ttft, 0.9), "ttft_max": max(ttft, default=math.nan),
            "ttft_misses": sum(1 for t in ttft if t > ttft_slo),
            "tbt_misses": sum(1 for r in done if r.tbt_s > tbt_slo)}


def with_decode_step(profile: Path, step: str, out: Path) -> Path:
    """A predictor file with ``profile``'s prefill and transfer predictors and the decode step
    ``a + b · batch + c · context tokens`` seconds of ``step`` = "a,b,c"."""
    a, b, c = (float(x) for x in step.split(","))
    pred = FittedCostModel.from_file(profile).predictors
    decode = DecodePredictor(BivariatePolynomial(((0, 0), (1, 0), (0, 1)), (a, b, c)))
    path = out / "predictors.json"
    save_predictors(replace(pred, decode=decode,
                            source=f"{pred.source}; decode {a} + {b}·batch + {c}·context s"), path)
    return path


def sweep(ns: argparse.Namespace) -> dict[str, Any]:
    rates = sorted(float(r) for r in ns.rates.split(","))
    seeds = [int(s) for s in ns.seeds.split(",")]
    loads = {(rate, seed): workload(ns.trace, ns.limit, rate, seed, ns.max_output)
             for rate in rates for seed in seeds}
    interference = None if ns.no_colocated else (ns.interference or ns.profile)
    result: dict[str, Any] = {"orders": {}, "rates": rates, "seeds": seeds, "limit": ns.limit,
                              "max_output": ns.max_output,
                              "colocated": not ns.no_colocated, "target": ns.target,
                              "ttft_slo_s": ns.ttft_slo, "tbt_slo_s": ns.tbt_slo}
    for spec in ns.orders.split(","):
        name, aging = parse_order(spec)
        rows: dict[str, Any] = {}
        for rate in rates:
            runs = [run_one(loads[rate, s], ns.profile, interference, name, aging,
                            ns.ttft_slo, ns.tbt_slo) for s in seeds]
            rows[str(rate)] = {
                "attainment_mean": sum(r["attainment"] for r in runs) / len(runs),
                "attainment_min": min(r["attainment"] for r in runs),
                **{k: sum(r[k] for r in runs) / len(runs)
                   for k in ("ttft_p50", "ttft_p90", "ttft_max", "ttft_misses", "tbt_misses")},
                "per_seed": runs}
        passing = [r for r in rates if rows[str(r)]["attainment_mean"] >= ns.target]
        max_rate = None
        for r in rates:  # the highest rate with every rate up to it passing
            if r not in passing:
                break
            max_rate = r
        result["orders"][spec] = {"rows": rows, "max_rate": max_rate}
        print(f"{spec}: max rate {max_rate}", file=sys.stderr)
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| order | rate (req/s) | attainment mean (lowest) | TTFT p50 / p90 / max (s) | "
             "TTFT / TBT misses | max rate ≥ 90 % |", "|---|---|---|---|---|---|"]
    for spec, o in result["orders"].items():
        for rate, row in o["rows"].items():
            lines.append(
                f"| {spec} | {rate} | {row['attainment_mean']:.3f} ({row['attainment_min']:.3f})"
                f" | {row['ttft_p50']:.1f} / {row['ttft_p90']:.1f} / {row['ttft_max']:.1f} | "
                f"{row['ttft_misses']:.1f} / {row['tbt_misses']:.1f} | {o['max_rate']} |")
    return "\n".join(lines)


def plot(out: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for spec, o in result["orders"].items():
        rates = [float(r) for r in o["rows"]]
        a1.plot(rates, [row["attainment_mean"] for row in o["rows"].values()], "o-", label=spec)
        a2.plot(rates, [row["ttft_p90"] for row in o["rows"].values()], "o-", label=spec)
    a1.axhline(result["target"], color="grey", ls="--", lw=1)
    a1.set(xlabel="rate (req/s)", ylabel="SLO attainment (mean over seeds)",
           title=f"1P1D sim, {result['limit']} requests × {len(result['seeds'])} seeds")
    a2.axhline(result["ttft_slo_s"], color="grey", ls="--", lw=1)
    a2.set(xlabel="rate (req/s)", ylabel="TTFT p90 (s)", yscale="log", title="TTFT p90")
    a1.legend()
    fig.tight_layout()
    fig.savefig(out / "prefill_queue.png", dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--profile", type=Path, required=True,
                   help="predictor or samples file of `yuebing profile` (the cost model)")
    p.add_argument("--decode-step", default="",
                   help="a,b,c: replace the profile's decode predictor by a + b·batch + c·context "
                        "tokens seconds (e.g. when the decode profile was taken on a busy host)")
    p.add_argument("--interference", type=Path,
                   help="samples file of `yuebing profile --interference` with the factors "
                        "(default: --profile)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--rates", default="0.1,0.15,0.2,0.25,0.3")
    p.add_argument("--seeds", default="0,1,2,3,4", help="Poisson arrival seeds (repeats)")
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--max-output", type=int, default=128, help="cap on output tokens")
    p.add_argument("--orders", default="fifo,sjf_aging,edf,sjf_slack",
                   help="queue orders: name or sjf_aging:AGING")
    p.add_argument("--ttft-slo", type=float, default=10.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--no-colocated", action="store_true")
    ns = p.parse_args()
    ns.outdir.mkdir(parents=True, exist_ok=True)
    source = ns.profile
    if ns.decode_step:
        ns.profile = with_decode_step(ns.profile, ns.decode_step, ns.outdir)
    result = sweep(ns)
    result["profile"], result["decode_step"] = str(source), ns.decode_step
    md = table(result)
    (ns.outdir / "prefill_queue.json").write_text(json.dumps(result, indent=1))
    (ns.outdir / "prefill_queue.md").write_text(md + "\n")
    plot(ns.outdir, result)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
