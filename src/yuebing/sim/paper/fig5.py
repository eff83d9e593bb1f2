"""Figure 5: mean TTFT of the four prefill scheduling policies (16 nodes, conversation trace).

Mooncake with 8 prefill + 8 decode nodes replays the conversation trace once per prefill
selector of the shared Conductor policy (random, load balancing, local cache-aware, global
cache-aware, paper §4); the result maps each selector to its mean TTFT in seconds. The random
selector's outcome depends on which nodes the long prompts happen to land on, so it is averaged
over `RANDOM_SEEDS` (the per-seed values are in `random_by_seed`).
"""

from __future__ import annotations

from pathlib import Path

from yuebing.sim.paper.common import fast_config, paired_bars, run, save_figure
from yuebing.sim.system import SimConfig

POLICIES = ("random", "load_balance", "local_cache_aware", "global_cache_aware")
PAPER = {"random": 19.65, "load_balance": 5.27, "local_cache_aware": 3.58,
         "global_cache_aware": 3.07}
"""Paper Figure 5, mean TTFT in seconds."""
RANDOM_SEEDS = (0, 1, 2)


def config(policy: str, fast: bool = False, seed: int = 0) -> SimConfig:
    return fast_config(SimConfig(system="mooncake", prefill_nodes=8, decode_nodes=8,
                                 prefill_policy=policy, seed=seed), fast)


def _mean_ttft(trace_path: str | Path, cfg: SimConfig) -> float:
    return float(run(trace_path, cfg).summary["ttft_s"]["mean"])  # type: ignore[index]


def random_by_seed(trace_path: str | Path, fast: bool = False) -> dict[str, float]:
    return {str(s): _mean_ttft(trace_path, config("random", fast, s)) for s in RANDOM_SEEDS}


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, float]:
    """{policy: mean TTFT seconds} for the four prefill selectors (random: mean over seeds)."""
    out: dict[str, float] = {}
    for policy in POLICIES:
        if policy == "random":
            per_seed = random_by_seed(trace_path, fast)
            out[policy] = sum(per_seed.values()) / len(per_seed)
        else:
            out[policy] = _mean_ttft(trace_path, config(policy, fast))
    return out


def ratios(values: dict[str, float]) -> dict[str, float]:
    """Each policy's mean TTFT divided by global cache-aware's."""
    base = values["global_cache_aware"]
    return {k: v / base for k, v in values.items()}


def comparisons(result: dict[str, float], details: dict[str, object]) -> dict[str, object]:
    """Report rows beside the paper's: each policy's mean TTFT over global cache-aware's."""
    return {"ours": {"ratio_to_global": ratios(result)},
            "paper": {"ratio_to_global": ratios(PAPER)}}


def plot(result: dict[str, float], out_dir: str | Path) -> list[Path]:
    fig = paired_bars(POLICIES, result, PAPER, "mean TTFT (s)",
                      "Figure 5: prefill scheduling policies (8P+8D, conversation)", (7, 4))
    return [save_figure(fig, out_dir, "fig5_ttft_by_policy.png")]
