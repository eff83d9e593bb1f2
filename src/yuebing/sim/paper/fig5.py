"""Figure 5: mean TTFT of the four prefill scheduling policies (16 nodes, conversation trace).

Mooncake with 8 prefill + 8 decode nodes replays the conversation trace once per prefill
selector of the shared Conductor policy (random, load balancing, local cache-aware, global
cache-aware, paper §4); the result maps each selector to its mean TTFT in seconds.
"""

from __future__ import annotations

from pathlib import Path

from yuebing.sim.paper.common import fast_config, pyplot, run
from yuebing.sim.system import SimConfig

POLICIES = ("random", "load_balance", "local_cache_aware", "global_cache_aware")
PAPER = {"random": 19.65, "load_balance": 5.27, "local_cache_aware": 3.58,
         "global_cache_aware": 3.07}
"""Paper Figure 5, mean TTFT in seconds."""


def config(policy: str, fast: bool = False) -> SimConfig:
    return fast_config(SimConfig(system="mooncake", prefill_nodes=8, decode_nodes=8,
                                 prefill_policy=policy), fast)


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, float]:
    """{policy: mean TTFT seconds} for the four prefill selectors."""
    out: dict[str, float] = {}
    for policy in POLICIES:
        summary = run(trace_path, config(policy, fast)).summary
        out[policy] = float(summary["ttft_s"]["mean"])  # type: ignore[index]
    return out


def ratios(values: dict[str, float]) -> dict[str, float]:
    """Each policy's mean TTFT divided by global cache-aware's."""
    base = values["global_cache_aware"]
    return {k: v / base for k, v in values.items()}


def plot(result: dict[str, float], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(POLICIES))
    ax.bar([x - 0.2 for x in xs], [result[p] for p in POLICIES], 0.4, label="yuebing sim")
    ax.bar([x + 0.2 for x in xs], [PAPER[p] for p in POLICIES], 0.4, label="paper")
    ax.set_xticks(list(xs), [p.replace("_", "\n") for p in POLICIES])
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("Figure 5: prefill scheduling policies (8P+8D, conversation)")
    ax.legend()
    fig.tight_layout()
    path = Path(out_dir) / "fig5_ttft_by_policy.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
