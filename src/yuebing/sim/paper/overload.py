"""arXiv §7 overload experiment: rejections and load oscillation under 2× trace speed.

8 prefill + 8 decode Mooncake nodes replay the conversation trace at twice its speed with three
admission policies of the shared Conductor policy: ``baseline`` (no check at arrival: a request
is dropped at prefill when it can no longer meet its TTFT SLO, and at decode when its KV cannot
join a batch or would break the TBT SLO, wasting its prefill), ``early_rejection`` and
``predictive_early_rejection`` (decide at arrival; the prefill/decode checks stay as a net;
it routes to decode by the same forecast it admits by). `details` also runs a decode-bound
`VARIANT`: on this trace our 8 decode nodes never fill at 2× (≈ 7 % KV use; a Table 1 decode
node holds 1.33 M tokens of KV), while the arXiv text describes a decode-bound run, so the
variant keeps the 8 prefill nodes and shrinks the decode pool to 2 nodes, the largest one
that saturates at 2× (3 decode nodes stay at ≈ 33 % KV use; docs/reproduction.md).

Load oscillation of a sampled load series (every 5 s; prefill load = mean queued seconds / TTFT
SLO; decode load = mean KV reserved / KV capacity): its standard deviation, its mean absolute
change between consecutive samples, and its variance in the `OSCILLATION_BAND_S` band of periods
(the arXiv's oscillation is a feedback loop whose delay is a TTFT plus a decode, 10–60 s here,
so periods of 20 s to 5 min; slower changes follow the trace's own rate, the same for every
policy).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from yuebing.sim.paper.common import fast_config, paired_bars, pyplot, run, save_figure
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
INTERVAL_S = 5.0
"""Load sampling period of the overload runs."""
OSCILLATION_BAND_S = (20.0, 300.0)
"""Periods (s) whose variance `oscillation` reports as ``band_var``."""


VARIANT = (8, 2)
"""(prefill, decode) nodes of the decode-bound variant."""


def config(name: str, fast: bool = False, nodes: tuple[int, int] = (8, 8)) -> SimConfig:
    return fast_config(SimConfig(system="mooncake", prefill_nodes=nodes[0], decode_nodes=nodes[1],
                                 admission=ADMISSIONS[name], decode_policy=DECODE[name],
                                 speed=SPEED, prefill_reject=True,
                                 decode_reject=True, sample_interval_s=INTERVAL_S), fast)


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, int]:
    """{admission name: rejected requests}."""
    return {name: int(run(trace_path, config(name, fast)).summary["rejected"])  # type: ignore[call-overload]
            for name in ADMISSIONS}


def oscillation(series: list[float], interval_s: float = INTERVAL_S) -> dict[str, float]:
    """``std``, ``swing`` (mean absolute change between consecutive samples) and ``band_var``
    (variance carried by periods inside `OSCILLATION_BAND_S`, from the one-sided spectrum) of
    a load series sampled every ``interval_s`` seconds."""
    x = np.asarray(series, dtype=float)
    n = len(x)
    if n < 2:
        return {"std": 0.0, "swing": 0.0, "band_var": 0.0}
    spectrum = np.abs(np.fft.rfft(x - x.mean())) ** 2 / n**2
    spectrum[1:(n + 1) // 2] *= 2.0  # one-sided: every bin but DC and Nyquist counts twice
    freq = np.fft.rfftfreq(n, interval_s)
    lo, hi = OSCILLATION_BAND_S
    band = (freq >= 1.0 / hi) & (freq <= 1.0 / lo)
    return {"std": float(np.std(x)), "swing": float(np.mean(np.abs(np.diff(x)))),
            "band_var": float(spectrum[band].sum())}


def _oscillation(res: object) -> dict[str, object]:
    ts = res.timeseries  # type: ignore[attr-defined]
    summary = res.summary  # type: ignore[attr-defined]
    out: dict[str, object] = {
        "rejected": summary["rejected"],
        "rejected_by_stage": summary["rejected_by_stage"],
        "rejected_by_reason": summary["rejected_by_reason"],
        "prefill_gpu_s": summary["prefill_gpu_s"],
    }
    for pool in ("prefill", "decode"):
        out[f"{pool}_load_mean"] = float(np.mean(ts[f"{pool}_load"]))
        for key, value in oscillation(ts[f"{pool}_load"]).items():
            out[f"{pool}_load_{key}"] = value
    return out


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
    names = list(ADMISSIONS)
    fig = paired_bars(names, result, PAPER, "rejected requests",
                      "Overload (8P+8D, trace ×2)", (6, 4))
    paths.append(save_figure(fig, out_dir, "overload_rejections.png"))
    if trace_path is not None:
        clusters = ((8, 8), VARIANT)
        fig, axes = plt.subplots(len(names), len(clusters), figsize=(13, 7), sharex=True,
                                 squeeze=False)
        for col, nodes in enumerate(clusters):
            for row, name in enumerate(names):
                ax = axes[row][col]
                ts = run(trace_path, config(name, fast, nodes)).timeseries
                ax.plot(ts["t_s"], ts["prefill_load"], label="prefill load", lw=0.8)
                ax.plot(ts["t_s"], ts["decode_load"], label="decode load", lw=0.8)
                ax.set_ylabel(name.replace("_", " "), fontsize=8)
            axes[0][col].set_title(f"{nodes[0]}P+{nodes[1]}D, trace ×{SPEED:g}", fontsize=9)
            axes[-1][col].set_xlabel("simulated time (s)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle("Overload: prefill / decode load over time")
        paths.append(save_figure(fig, out_dir, "overload_load.png"))
    return paths
