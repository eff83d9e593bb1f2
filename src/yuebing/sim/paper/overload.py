"""arXiv Table 3 overload experiment: rejections and load oscillation under 2× trace speed; run
by `yuebing sim paper` (`sim.paper.report`).

The arXiv's Kimi trace is not released, so `arxiv_like` rebuilds its statistics from the
conversation trace. Three admissions of the shared Conductor policy are compared: ``baseline``
(drops at prefill and at decode, wasting prefills), ``early_rejection`` (once, at arrival, on
the decode load of now) and ``predictive_early_rejection`` (the decode load forecast for when
the prefill ends, arXiv §7.4's forecast, not the live one that keeps the batch no lower than
now while the prefill pool has work: `config`). `details` adds the decode-bound 8P+2D and 7P+2D variants;
`oscillation` measures how the sampled loads swing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from yuebing.conductor.policy.types import RejectStage
from yuebing.sim.metrics import capacity_curve
from yuebing.sim.paper.common import (
    fast_config,
    paired_bars,
    pyplot,
    register_workload,
    requests,
    run,
    save_figure,
    workload_path,
)
from yuebing.sim.system import SimConfig, sim_policy
from yuebing.trace.io import load_trace
from yuebing.trace.model import Trace
from yuebing.trace.transform import scale_lengths, scale_time

ADMISSIONS = {"baseline": "none", "early_rejection": "early_rejection",
              "predictive_early_rejection": "predictive_early_rejection"}
DECODE = {"baseline": "least_loaded", "early_rejection": "least_loaded",
          "predictive_early_rejection": "forecast"}
"""Decode selector per admission: predictive early rejection routes by the same forecast it
admits by (arXiv §7.4), the others by the current load."""
PAPER = {"baseline": 4183, "early_rejection": 3771, "predictive_early_rejection": 3589}
"""arXiv 2407.00079 Table 3: rejected requests (of ≈ 23,000)."""
PAPER_REQUESTS = 23_000
ARXIV_INPUT_TOKENS = 7590
ARXIV_OUTPUT_TOKENS = 182
SPEED = 2.0
NODES = (8, 8)
INTERVAL_S = 5.0
"""Load sampling period of the overload runs."""
OSCILLATION_BAND_S = (20.0, 300.0)
"""Periods (s) whose variance `oscillation` reports as ``band_var``."""
LOAD_SERIES = {"prefill": "prefill_load", "decode": "decode_tbt_load"}
"""Pool → the time series of `yuebing.sim.mooncake.MooncakeSystem.load` its load is read from."""
WORKLOAD = "arxiv_like"
VARIANT = (8, 2)
"""(prefill, decode) nodes of the decode-bound variant: on 8P+8D (and 8P+3D) the decode pool of
Table 1 nodes never binds on this workload, on 8P+2D it does (the arXiv's decode pool ran at
35-95 % load)."""
PREFILL_BOUND = (7, 2)
"""(prefill, decode) nodes of the variant where both pools bind, the prefill more: the regime
the arXiv's gains need (rejections at the prefill's TTFT SLO, and decode re-checks that waste
prefill on bursts). Not the paper's cluster: a check that the policies act as described."""
VARIANTS = (VARIANT, PREFILL_BOUND)


def arxiv_like(base: Path) -> Trace:
    """The conversation trace ``base`` with the arXiv trace's mean lengths and request rate
    (see the module docstring).

    The arXiv report (2407.00079 §7–8.2) replays ≈ 23,000 requests in an hour (mean input 7,590,
    output 182 tokens) at twice its speed on 8P+8D. Here every prompt and output length of the
    conversation trace is scaled so the means are 7,590 and 182 (prefix sharing kept block for
    block, `yuebing.trace.transform.scale_lengths`) and the timestamps compressed to 23,000 an hour
    (the 12,031 requests then span ≈ 31 minutes)."""
    trace = load_trace(base)
    reqs = trace.requests
    mean_in = sum(r.input_length for r in reqs) / len(reqs)
    mean_out = sum(r.output_length for r in reqs) / len(reqs)
    scaled = scale_lengths(trace, ARXIV_INPUT_TOKENS / mean_in, ARXIV_OUTPUT_TOKENS / mean_out)
    times = [r.timestamp for r in reqs]
    span_h = (max(times) - min(times)) / 3_600_000
    return scale_time(scaled, len(reqs) / span_h / PAPER_REQUESTS)


register_workload(WORKLOAD, arxiv_like)


def config(name: str, fast: bool = False, nodes: tuple[int, int] = NODES) -> SimConfig:
    """The run of admission ``name`` on ``nodes``. The forecast is arXiv §7.4's
    (``forecast_hold=False``): the live default, which keeps the decode batch no lower than now
    while the prefill pool has work, rejects more on an overloaded 8P+2D than the baseline
    (2,443 against 1,367; docs/reproduction.md, gap D), and Table 3 counts rejections."""
    return fast_config(SimConfig(system="mooncake", prefill_nodes=nodes[0], decode_nodes=nodes[1],
                                 policy=sim_policy(admission=ADMISSIONS[name],
                                                   decode_selector=DECODE[name],
                                                   forecast_hold=False),
                                 speed=SPEED, prefill_reject=name == "baseline",
                                 decode_reject=name == "baseline",
                                 sample_interval_s=INTERVAL_S), fast)


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, int]:
    """{admission name: rejected requests} on the arXiv-like workload built from the trace."""
    path = workload_path(WORKLOAD, trace_path)
    return {name: int(run(path, config(name, fast)).summary["rejected"])  # type: ignore[call-overload]
            for name in ADMISSIONS}


def oscillation(series: list[float], interval_s: float = INTERVAL_S) -> dict[str, float]:
    """``std``, ``swing`` (mean absolute change between consecutive samples) and ``band_var``
    (variance carried by periods inside `OSCILLATION_BAND_S`, from the one-sided spectrum) of
    a load series sampled every ``interval_s`` seconds.

    The series is sampled every 5 s (prefill load = mean queued seconds / TTFT SLO; decode load =
    mean predicted TBT of the running batches / TBT SLO, the arXiv's definition). Its standard
    deviation, mean absolute change between samples, and variance in the `OSCILLATION_BAND_S` band
    of periods (the arXiv's oscillation is a feedback loop whose delay is a TTFT plus a decode, so
    periods of 20 s to 5 min; slower changes follow the trace's own rate)."""
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
        "wasted_prefill_gpu_s": sum(r.prefill_gpu_s for r in res.records  # type: ignore[attr-defined]
                                    if r.rejected is RejectStage.DECODE),
        # share of all requests served within the TTFT and TBT SLOs (the price of admitting)
        "slo_met_share": capacity_curve(res.records,  # type: ignore[attr-defined]
                                        [res.config.policy.tbt_slo_s])[0][1],  # type: ignore[attr-defined]
    }
    for pool, series in LOAD_SERIES.items():
        out[f"{pool}_load_mean"] = float(np.mean(ts[series]))
        for key, value in oscillation(ts[series]).items():
            out[f"{pool}_load_{key}"] = value
    out["decode_kv_load_mean"] = float(np.mean(ts["decode_load"]))
    return out


def details(trace_path: str | Path, fast: bool = False) -> dict[str, object]:
    """The workload's statistics, the paper's and our rejections as a share of the requests
    and relative to the baseline, and per admission the rejections by stage/reason, the
    prefill GPU time and the load oscillation."""
    path = workload_path(WORKLOAD, trace_path)
    reqs = requests(path, SPEED, config("baseline", fast).limit)
    n = len(reqs)
    per: dict[str, dict[str, object]] = {
        name: _oscillation(run(path, config(name, fast))) for name in ADMISSIONS}
    base, paper_base = per["baseline"]["rejected"], PAPER["baseline"]
    return {
        "workload": {"requests": n,
                     "mean_input": sum(r.input_tokens for r in reqs) / n,
                     "mean_output": sum(r.output_tokens for r in reqs) / n,
                     "requests_per_hour_at_1x": n / (reqs[-1].arrival_s * SPEED / 3600)},
        "rejected_share": {k: int(v["rejected"]) / n for k, v in per.items()},  # type: ignore[call-overload]
        "paper_rejected_share": {k: v / PAPER_REQUESTS for k, v in PAPER.items()},
        "vs_baseline": {k: int(v["rejected"]) / int(base) - 1 if base else None  # type: ignore[call-overload]
                        for k, v in per.items()},
        "paper_vs_baseline": {k: v / paper_base - 1 for k, v in PAPER.items()},
        "by_policy": per,
        **{_name(nodes): {name: _oscillation(run(path, config(name, fast, nodes)))
                          for name in ADMISSIONS} for nodes in VARIANTS},
    }


def _name(nodes: tuple[int, int]) -> str:
    return f"{nodes[0]}P+{nodes[1]}D"


def comparisons(result: dict[str, int], details: dict[str, object]) -> dict[str, object]:
    """Report rows beside the paper's: rejected shares and the change vs the baseline on the
    paper's 8P+8D and on each variant present in ``details`` (the paper's values for all)."""
    paper_vs = details["paper_vs_baseline"]
    ours: dict[str, object] = {"rejected_share": details["rejected_share"],
                               "vs_baseline": details["vs_baseline"]}
    paper: dict[str, object] = {"rejected_share": details["paper_rejected_share"],
                                "vs_baseline": paper_vs}
    for nodes in VARIANTS:
        variant = details.get(_name(nodes))
        if not isinstance(variant, dict):
            continue
        base = variant["baseline"]["rejected"]
        ours[f"{_name(nodes)}_vs_baseline"] = {
            k: v["rejected"] / base - 1 if base else None for k, v in variant.items()}
        paper[f"{_name(nodes)}_vs_baseline"] = paper_vs
    return {"ours": ours, "paper": paper}


def plot(result: dict[str, int], out_dir: str | Path, trace_path: str | Path | None = None,
         fast: bool = False) -> list[Path]:
    plt = pyplot()
    paths: list[Path] = []
    names = list(ADMISSIONS)
    fig = paired_bars(names, result, PAPER, "rejected requests",
                      "Overload (8P+8D, arXiv-like workload ×2)", (6, 4))
    paths.append(save_figure(fig, out_dir, "overload_rejections.png"))
    if trace_path is not None:
        path = workload_path(WORKLOAD, trace_path)
        clusters = (NODES, *VARIANTS)
        fig, axes = plt.subplots(len(names), len(clusters), figsize=(18, 7), sharex=True,
                                 squeeze=False)
        for col, nodes in enumerate(clusters):
            for row, name in enumerate(names):
                ax = axes[row][col]
                ts = run(path, config(name, fast, nodes)).timeseries
                ax.plot(ts["t_s"], ts[LOAD_SERIES["prefill"]], label="prefill load (queue / TTFT SLO)",
                        lw=0.8)
                ax.plot(ts["t_s"], ts[LOAD_SERIES["decode"]], label="decode load (TBT / TBT SLO)",
                        lw=0.8)
                ax.set_ylabel(name.replace("_", " "), fontsize=8)
            axes[0][col].set_title(f"{nodes[0]}P+{nodes[1]}D", fontsize=9)
            axes[-1][col].set_xlabel("simulated time (s)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"Overload: load over time (arXiv-like workload ×{SPEED:g})")
        paths.append(save_figure(fig, out_dir, "overload_load.png"))
    return paths
