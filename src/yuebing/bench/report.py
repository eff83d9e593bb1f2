"""Outputs of ``yuebing bench serve``: the JSON report, the terminal tables, per-request
records and the PNG plots.

Who calls what: the CLI (`yuebing.cli.cmd_bench`) builds `report` from the runs, prints it with
`strict_json` (``--json``) or `print_tables`, writes `write_records` (``--records``) and
`plot_all` (``--plot DIR``: CDFs of TTFT and TBT per run with the SLO thresholds, and, for a
sweep, SLO attainment vs offered rate per TBT threshold with the target line). Paths are
checked by `check_out_paths` before any load is sent.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from yuebing.bench.config import BenchConfig
from yuebing.bench.metrics import max_sustained_rate
from yuebing.bench.result import Status
from yuebing.bench.runner import Run
from yuebing.core.errors import InputError


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def strict_json(obj: Any, indent: int | None = None) -> str:
    """Standard JSON: NaN and infinities become null."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


def check_out_paths(records: Path | None, plot_dir: Path | None) -> None:
    """Before any load, changing nothing: `InputError` when ``--records``' directory is
    missing, or ``--plot`` is not a directory and cannot be made one (its nearest existing
    ancestor is not a writable directory)."""
    if records is not None and not records.parent.is_dir():
        raise InputError(f"--records {str(records)!r}: directory '{records.parent}' does not "
                         "exist")
    if plot_dir is None:
        return
    existing = next(p for p in (plot_dir, *plot_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--plot {str(plot_dir)!r}: cannot create the directory "
                         f"('{existing}' is not a writable directory)")


def report(cfg: BenchConfig, model: str, source: str, runs: Sequence[Run],
           sweep: bool) -> dict[str, Any]:
    """The whole result as JSON-ready data: config, model, one entry per run, and for a
    sweep the maximum rate that reaches the target attainment; ``"interrupted": true`` when
    Ctrl-C stopped the last run (its summary covers the requests answered before)."""
    out: dict[str, Any] = {"config": asdict(cfg), "model": model, "workload": source}
    if any(r.interrupted for r in runs):
        out["interrupted"] = True
    if not sweep:
        out["summary"] = runs[0].summary
        return out
    pairs = [(r.rate or 0.0, r.summary) for r in runs]
    out["sweep"] = [{"rate": rate, "summary": s} for rate, s in pairs]
    out["target_attainment"] = cfg.target_attainment
    out["max_rate"] = max_sustained_rate(pairs, cfg.target_attainment)
    return out


def write_records(path: Path, runs: Sequence[Run]) -> None:
    """One JSON line per request (with its run's rate), written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w") as fh:
            for run in runs:
                for r in run.results:
                    fh.write(strict_json({"rate": run.rate, **r.to_json()}) + "\n")
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write --records {str(path)!r}: {e.strerror or e}") from None


def _ms(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1000:,.0f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


_ROWS: tuple[tuple[str, Any], ...] = (
    ("sent", lambda s: str(s["requests"])),
    ("completed", lambda s: str(s["completed"])),
    ("rejected (429)", lambda s: str(s["rejected"])),
    ("errors", lambda s: str(s["errors"])),
    ("TTFT p50 / p90 / p99 ms", lambda s: " / ".join(
        _ms(s["ttft_s"][k]) for k in ("p50", "p90", "p99"))),
    ("TBT p50 / p90 / p99 ms", lambda s: " / ".join(
        _ms(s["tbt_s"][k]) for k in ("p50", "p90", "p99"))),
    ("ITL mean / P90 ms (mean over requests)", lambda s: (
        f"{_ms(s['itl_mean_s']['mean'])} / {_ms(s['itl_p90_s']['mean'])}")),
    ("end-to-end p50 / p90 ms", lambda s: f"{_ms(s['e2e_s']['p50'])} / {_ms(s['e2e_s']['p90'])}"),
    ("attainment (first SLOs)", lambda s: f"{s['attainment']:.3f}" if "cut_short" not in s
     else f"≤ {s['attainment']:.3f} (cut short after {s['cut_short']['answered']} of "
          f"{s['cut_short']['of']})"),
    ("goodput req/s", lambda s: f"{s['goodput_rps']:.3f}"),
    ("goodput output tok/s", lambda s: f"{s['goodput_tokens_per_s']:,.1f}"),
    ("throughput output tok/s", lambda s: f"{s['output_tokens_per_s']:,.1f}"),
    ("cached prompt share", lambda s: _share(s["tokens"]["cached_share"])),
    ("send lag max ms", lambda s: "-" if s["send_lag_s"] is None else
     _ms(s["send_lag_s"]["max"])),
)


def print_tables(rep: dict[str, Any], runs: Sequence[Run], cfg: BenchConfig) -> None:
    """One column per run: counts, latency percentiles, attainment, goodput; then the SLO
    grid (attainment per TTFT × TBT threshold), errors by kind and a sweep's maximum rate."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"{rep['model']} @ {cfg.endpoint} ({cfg.api}): {rep['workload']}")
    table.add_column("metric")
    for run in runs:
        table.add_column(run.label, justify="right")
    for name, cell in _ROWS:
        table.add_row(name, *(cell(run.summary) for run in runs))
    console.print(table)
    grid = Table(title="SLO attainment (share of all requests sent)")
    grid.add_column("TTFT ≤ / TBT ≤")
    for run in runs:
        grid.add_column(run.label, justify="right")
    for x in cfg.slo_ttft:
        for y in cfg.slo_tbt:
            cells = [next(row["attainment"] for row in run.summary["slo"]
                          if (row["ttft_s"], row["tbt_s"]) == (x, y)) for run in runs]
            grid.add_row(f"{x:g} s / {y * 1000:g} ms", *(f"{c:.3f}" for c in cells))
    console.print(grid)
    for run in runs:
        if run.summary["errors_by_kind"]:
            console.print(f"{run.label}: errors by kind {run.summary['errors_by_kind']}")
    if rep.get("interrupted"):
        console.print("interrupted: the last run covers only the requests answered before "
                      "Ctrl-C")
    if "max_rate" in rep:
        best = rep["max_rate"]
        console.print(f"max rate with attainment ≥ {cfg.target_attainment:g}: "
                      + ("none of the swept rates" if best is None else f"{best:g} req/s"))


def _cdf(ax: Any, runs: Sequence[Run], attr: str, thresholds: Sequence[float],
         title: str) -> None:
    import numpy as np

    for run in runs:
        x = np.sort([getattr(r, attr) for r in run.results if r.status is Status.OK])
        if x.size:
            ax.step(x * 1000, np.arange(1, x.size + 1) / x.size, where="post", label=run.label)
    for t in thresholds:
        ax.axvline(t * 1000, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("share of completed requests")
    ax.set_title(f"CDF of {title}")
    ax.legend(fontsize="small")


def plot_all(out_dir: Path, runs: Sequence[Run], cfg: BenchConfig, sweep: bool) -> list[Path]:
    """Write ttft_cdf.png, tbt_cdf.png and (sweep) attainment_vs_rate.png into ``out_dir``
    (made if missing); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--plot {str(out_dir)!r}: cannot create the directory: "
                         f"{e.strerror or e}") from None
    paths = []
    for name, attr, thresholds, title in (("ttft_cdf", "ttft_s", cfg.slo_ttft, "TTFT"),
                                          ("tbt_cdf", "tbt_s", cfg.slo_tbt, "TBT")):
        fig, ax = plt.subplots(figsize=(6, 4))
        _cdf(ax, runs, attr, thresholds, title)
        paths.append(_save(fig, out_dir / f"{name}.png"))
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        ordered = sorted(runs, key=lambda r: r.rate or 0.0)
        rates = [r.rate or 0.0 for r in ordered]
        for y in cfg.slo_tbt:
            key = str(round(y * 1000))
            ax.plot(rates, [r.summary["capacity"][key] for r in ordered], marker="o",
                    label=f"TBT ≤ {y * 1000:g} ms")
        ax.axhline(cfg.target_attainment, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel(f"SLO attainment (TTFT ≤ {cfg.slo_ttft[0]:g} s)")
        ax.set_ylim(0, 1.02)
        ax.set_title("SLO attainment vs rate")
        ax.legend(fontsize="small")
        paths.append(_save(fig, out_dir / "attainment_vs_rate.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise InputError(f"cannot write plot {str(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
