"""arXiv §7 overload experiment: rejections and load oscillation under 2× trace speed.

8 prefill + 8 decode Mooncake nodes replay the conversation trace at twice its speed with three
admission policies of the shared Conductor policy: ``baseline`` (no check at arrival: a request
is dropped at prefill when it can no longer meet its TTFT SLO, and at decode when its KV cannot
join a batch or would break the TBT SLO, wasting its prefill), ``early_rejection`` and
``predictive_early_rejection`` (decide at arrival; the prefill/decode checks stay as a net).
`details` also runs a decode-bound variant (14 prefill + 2 decode nodes, same speed), because
with our cost model the 8P+8D cluster is prefill-bound on this trace (docs/reproduction.md). Load oscillation = standard deviation of the sampled load series (prefill
load = mean queued seconds / TTFT SLO; decode load = mean KV reserved / KV capacity).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from yuebing.sim.paper.common import fast_config, pyplot, run
from yuebing.sim.system import SimConfig

ADMISSIONS = {"baseline": "none", "early_rejection": "early_rejection",
              "predictive_early_rejection": "predictive_early_rejection"}
DECODE = {"baseline": "least_loaded", "early_rejection": "least_loaded",
          "predictive_early_rejection": "forecast"}
"""Decode selector per admission: predictive early rejection routes by the same forecast it
admits by (arXiv §7.4), the others by the current load."""
PAPER = {"baseline": 4183, "early_rejection": 3771, "predictive_early_rejection": 3589}
"""arXiv 2407.00079 §7: rejected requests."""
SPEED = 2.0


VARIANT = (14, 2)
"""(prefill, decode) nodes of the decode-bound variant."""


def config(name: str, fast: bool = False, nodes: tuple[int, int] = (8, 8)) -> SimConfig:
    return fast_config(SimConfig(system="mooncake", prefill_nodes=nodes[0], decode_nodes=nodes[1],
                                 admission=ADMISSIONS[name], decode_policy=DECODE[name],
                                 speed=SPEED, prefill_reject=True,
                                 decode_reject=True, sample_interval_s=5.0), fast)


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, int]:
    """{admission name: rejected requests}."""
    return {name: int(run(trace_path, config(name, fast)).summary["rejected"])  # type: ignore[call-overload]
            for name in ADMISSIONS}


def _oscillation(res: object) -> dict[str, object]:
    ts = res.timeseries  # type: ignore[attr-defined]
    summary = res.summary  # type: ignore[attr-defined]
    return {
        "rejected": summary["rejected"],
        "rejected_by_stage": summary["rejected_by_stage"],
        "rejected_by_reason": summary["rejected_by_reason"],
        "prefill_load_std": float(np.std(ts["prefill_load"])),
        "decode_load_std": float(np.std(ts["decode_load"])),
        "prefill_gpu_s": summary["prefill_gpu_s"],
    }


def details(trace_path: str | Path, fast: bool = False) -> dict[str, dict[str, object]]:
    """Per admission: rejections by stage/reason and the load oscillation (std of samples),
    for the 8P+8D cluster and for the decode-bound `VARIANT`."""
    out: dict[str, dict[str, object]] = {}
    for nodes in ((8, 8), VARIANT):
        label = f"{nodes[0]}P+{nodes[1]}D"
        for name in ADMISSIONS:
            out[f"{label} {name}"] = _oscillation(run(trace_path, config(name, fast, nodes)))
    return out


def plot(result: dict[str, int], out_dir: str | Path, trace_path: str | Path | None = None,
         fast: bool = False) -> list[Path]:
    plt = pyplot()
    paths: list[Path] = []
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(ADMISSIONS)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [result[n] for n in names], 0.4, label="yuebing sim")
    ax.bar([x + 0.2 for x in xs], [PAPER[n] for n in names], 0.4, label="paper")
    ax.set_xticks(list(xs), [n.replace("_", "\n") for n in names])
    ax.set_ylabel("rejected requests")
    ax.set_title("Overload (8P+8D, trace ×2)")
    ax.legend()
    fig.tight_layout()
    paths.append(Path(out_dir) / "overload_rejections.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if trace_path is not None:
        fig, axes = plt.subplots(len(names), 1, figsize=(9, 7), sharex=True)
        for ax, name in zip(axes, names, strict=True):
            ts = run(trace_path, config(name, fast)).timeseries
            ax.plot(ts["t_s"], ts["prefill_load"], label="prefill load", lw=0.8)
            ax.plot(ts["t_s"], ts["decode_load"], label="decode load", lw=0.8)
            ax.set_ylabel(name.replace("_", " "), fontsize=8)
        axes[0].legend(fontsize=8)
        axes[-1].set_xlabel("simulated time (s)")
        fig.suptitle("Overload: prefill / decode load over time")
        fig.tight_layout()
        paths.append(Path(out_dir) / "overload_load.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
