"""The simulator's CPP TTFT against a live `benchmarks/cpp_ttft.py` run on the same profile.

Replays one ``--tokens``-token prompt (nothing cached) through the simulator twice, with the
cost model fitted from ``--profile`` (`yuebing profile`'s predictor or samples file of the live
instances' engine: same model, threads, kernels): once on one prefill node, once on a declared
group of ``--stages`` stages with the live stages' chunk (``--chunk``, their
``--max-batch-tokens``) and boundary bytes per token (2 x hidden x 2 bf16 bytes). Prints JSON:
both simulated TTFTs, the live ones (``--live``: cpp_ttft.py's JSON output), sim / live for each
and whether each is within ±25 % (issue 27's target).

Usage:  PYTHONPATH=src .venv/bin/python benchmarks/cpp_sim_vs_live.py --profile P.json
        [--live cpp.json] [--tokens 8000] [--stages 2] [--chunk 512] [--boundary-bytes 2304]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="yuebing profile's predictor/samples file")
    ap.add_argument("--live", default="", help="cpp_ttft.py's JSON output (optional)")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512, help="the stages' --max-batch-tokens")
    ap.add_argument("--boundary-bytes", type=int, default=2 * 576 * 2,
                    help="boundary bytes per token (SmolLM2: 2 x 576 x 2)")
    args = ap.parse_args()
    single, group = sim_ttfts(FittedCostModel.from_file(args.profile), args.tokens, args.stages,
                              args.chunk, args.boundary_bytes)
    out: dict[str, object] = {"tokens": args.tokens, "stages": args.stages, "chunk": args.chunk,
                              "sim_ttft_single_s": round(single, 3),
                              "sim_ttft_group_s": round(group, 3),
                              "sim_group_over_single": round(group / single, 3)}
    if args.live:
        live = json.loads(Path(args.live).read_text())
        for key in ("single", "group"):
            ratio = out[f"sim_ttft_{key}_s"] / live[f"ttft_{key}_s"]  # type: ignore[operator]
            out[f"live_ttft_{key}_s"] = live[f"ttft_{key}_s"]
            out[f"sim_over_live_{key}"] = round(ratio, 3)
            out[f"within_25pct_{key}"] = 0.75 <= ratio <= 1.25
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
