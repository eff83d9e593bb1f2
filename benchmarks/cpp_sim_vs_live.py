"""The simulator's CPP TTFT against a live `benchmarks/cpp_ttft.py` run on the same profile.

Replays one ``--tokens``-token prompt (nothing cached) through the simulator twice, with the
cost model fitted from ``--profile`` (`yuebing profile`'s predictor or samples file of the live
instances' engine: same model, threads, kernels): once on one prefill node, once on a declared
group of ``--stages`` stages with the live stages' chunk (``--chunk``, their
``--max-batch-tokens``) and boundary bytes per token (2 x hidden x 2 bf16 bytes). Prints JSON:
both simulated TTFTs, the live ones (``--live``: cpp_ttft.py's JSON output), sim / live for each
and whether each is within ±25 % (issue 27's target). ``--live-steps DIR`` (cpp_ttft.py's
``--step-trace-dir``) sets each live chunk's engine step beside the profile's prediction for it
(new, cached tokens; a stage: 1/stages of it) and tells the steps' share of the live TTFT.

Usage:  PYTHONPATH=src .venv/bin/python benchmarks/cpp_sim_vs_live.py --profile P.json
        [--live cpp.json] [--live-steps DIR] [--tokens 8000] [--stages 2] [--chunk 512]
        [--boundary-bytes 2304]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from yuebing.sim.hardware import CostModel, FittedCostModel
from yuebing.sim.runner import simulate
from yuebing.sim.system import SimConfig, sim_policy
from yuebing.sim.workload import SimRequest


def sim_ttfts(cost: CostModel, tokens: int, stages: int, chunk: int,
              boundary_bytes: int) -> tuple[float, float]:
    """(TTFT on one prefill node, TTFT on a declared group of ``stages``), simulated."""
    req = [SimRequest(0, 0.0, tokens, 2, (1,))]
    cost.prefill_chunk_tokens = chunk  # the policy's and the group's chunk (`policy_config`)
    policy = sim_policy(block_tokens=tokens, cpp_threshold_tokens=1, cpp_chunk_tokens=chunk,
                        cpp_boundary_bytes_per_token=boundary_bytes, ttft_slo_s=1e6)
    base = SimConfig(prefill_nodes=1, decode_nodes=1, policy=policy)
    single = simulate(req, base, cost=cost).records[0]  # one node: a pipeline of one
    group = simulate(req, replace(base, cpp_groups=1, cpp_group_stages=stages),
                     cost=cost).records[0]
    assert group.prefill_id == "g0", f"the simulator kept the prompt off the group: {group}"
    return single.ttft_s, group.ttft_s


SAME = ("model", "dtype", "device", "threads", "attention", "prefill_attention", "kernels",
        "matmul", "max_batch_tokens", "block_size", "machine")
"""What the profile and the live instances must share for the comparison to mean anything."""


def mismatches(profile: dict[str, str], live: dict[str, str]) -> list[str]:
    """``key: profile value != live value`` for each of `SAME` both name and disagree on."""
    return [f"{k}: profile {profile[k]!r} != live {live[k]!r}" for k in SAME
            if k in profile and k in live and str(profile[k]) != str(live[k])]


def first_prompt_steps(path: Path, tokens: int) -> list[dict[str, float]]:
    """The steps of the first prompt of ``tokens`` tokens in a step trace: consecutive prefill
    steps from 0 cached tokens whose chunks add up to it."""
    run: list[dict[str, float]] = []
    for line in path.read_text().splitlines():
        s = json.loads(line)
        if not s.get("prefill_tokens"):
            continue
        if s["prefill_cached_tokens"] == 0:
            run = []
        run.append(s)
        if sum(r["prefill_tokens"] for r in run) == tokens:
            return run
    raise SystemExit(f"{path}: no prompt of {tokens} tokens prefilled from 0 cached tokens")


def steps_vs_profile(cost: FittedCostModel, steps: list[dict[str, float]], share: float,
                     ttft_s: float | None) -> dict[str, object]:
    """Live chunk steps against the predictor (times ``share``: a stage's layers), in quarters
    of the prompt, and the steps' sum against the live TTFT."""
    pred = [share * cost.predictors.prefill.predict(s["prefill_tokens"],
                                                    s["prefill_cached_tokens"]) for s in steps]
    live = [s["step_s"] for s in steps]
    q = max(1, len(steps) // 4)
    out: dict[str, object] = {
        "chunks": len(steps), "steps_s": round(sum(live), 3), "predicted_s": round(sum(pred), 3),
        "live_over_predicted": round(sum(live) / sum(pred), 3),
        "live_over_predicted_by_quarter": [round(sum(live[i:i + q]) / sum(pred[i:i + q]), 3)
                                           for i in range(0, len(steps), q)]}
    if ttft_s:
        out["steps_over_ttft"] = round(sum(live) / ttft_s, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="yuebing profile's predictor/samples file")
    ap.add_argument("--live", default="", help="cpp_ttft.py's JSON output (optional)")
    ap.add_argument("--live-steps", type=Path, default=None,
                    help="cpp_ttft.py's --step-trace-dir: single.steps.jsonl, stage0... (optional)")
    ap.add_argument("--allow-mismatch", action="store_true",
                    help="compare even when the profile's engine differs from the live one")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512, help="the stages' --max-batch-tokens")
    ap.add_argument("--boundary-bytes", type=int, default=2 * 576 * 2,
                    help="boundary bytes per token (SmolLM2: 2 x 576 x 2)")
    args = ap.parse_args()
    cost = FittedCostModel.from_file(args.profile)
    single, group = sim_ttfts(cost, args.tokens, args.stages, args.chunk, args.boundary_bytes)
    out: dict[str, object] = {"tokens": args.tokens, "stages": args.stages, "chunk": args.chunk,
                              "sim_ttft_single_s": round(single, 3),
                              "sim_ttft_group_s": round(group, 3),
                              "sim_group_over_single": round(group / single, 3)}
    if args.live:
        live = json.loads(Path(args.live).read_text())
        differ = mismatches(dict(cost.predictors.configuration), live.get("engine", {}))
        if differ and not args.allow_mismatch:
            raise SystemExit(f"{args.profile} was profiled on another engine than {args.live}'s "
                             f"instances: {'; '.join(differ)} (--allow-mismatch to compare "
                             "anyway)")
        out["engine_mismatches"] = differ
        for key in ("single", "group"):
            ratio = out[f"sim_ttft_{key}_s"] / live[f"ttft_{key}_s"]  # type: ignore[operator]
            out[f"live_ttft_{key}_s"] = live[f"ttft_{key}_s"]
            out[f"sim_over_live_{key}"] = round(ratio, 3)
            out[f"within_25pct_{key}"] = 0.75 <= ratio <= 1.25
    if args.live_steps:
        live_ttft = json.loads(Path(args.live).read_text()) if args.live else {}
        for name, share, ttft in (("single", 1.0, live_ttft.get("ttft_single_s")),
                                  *((f"stage{i}", 1 / args.stages, live_ttft.get("ttft_group_s"))
                                    for i in range(args.stages))):
            steps = first_prompt_steps(args.live_steps / f"{name}.steps.jsonl", args.tokens)
            out[f"steps_{name}"] = steps_vs_profile(cost, steps, share, ttft)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
