"""``yuebing sim paper``: run every figure module and write PNGs, report.json and report.md.

Life cycle: `run_figures` imports each requested figure module (see `FIGURES`), calls its
``compute(trace, fast)`` (simulations are shared between figures through the memo in
`yuebing.sim.paper.common`), then ``plot(result, out_dir)``; `write_report` stores
``report.json`` ({figure: {"ours", "paper", "details"}}, plus ``"compare"`` where the module
defines ``comparisons(result, details)``: {"ours": {...}, "paper": {...}} of derived quantities
such as shares and ratios) and ``report.md`` (our numbers beside the paper's, with the gap). A
figure whose module is missing is reported as unavailable instead of failing the whole report.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from yuebing.core.errors import InputError

log = logging.getLogger(__name__)

FIGURES = {"1": "fig1", "5": "fig5", "8": "fig8", "9": "fig9", "10": "fig10", "11": "fig11",
           "14": "fig14", "15": "fig15", "overload": "overload", "longctx": "longctx"}
"""Figure name (as typed after ``--figure``) → module in `yuebing.sim.paper`."""
DEFAULT_TRACE = Path("..") / "shared" / "traces" / "conversation_trace.jsonl"


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def strict_json(obj: Any, indent: int | None = None) -> str:
    """Standard JSON (no ``NaN``/``Infinity`` tokens): a non-finite float (no value, e.g. the
    mean TTFT of a run where nothing completed) becomes ``null``; other objects become str."""
    return json.dumps(_finite(obj), indent=indent, default=str, allow_nan=False)


def check_figure(name: str) -> None:
    """Raise `InputError` unless ``name`` is a key of `FIGURES`."""
    if name not in FIGURES:
        raise InputError(f"unknown figure {name!r}; choose one of {', '.join(FIGURES)}")


def ensure_dir(path: Path) -> Path:
    """Create directory ``path`` (and parents); `InputError` naming it when that fails."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create output directory '{path}': {e.strerror or e}") from None
    return path


def figure_module(name: str) -> ModuleType | None:
    """The module of figure ``name``; None when it is not installed yet."""
    check_figure(name)
    modname = f"yuebing.sim.paper.{FIGURES[name]}"
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name != modname:
            raise
        return None


def compute_figure(name: str, trace: Path, fast: bool) -> dict[str, Any]:
    """{"ours": result, "paper": PAPER, "details": extra, "seconds": wall time}."""
    mod = figure_module(name)
    if mod is None:
        return {"ours": None, "paper": None, "details": "figure module not available",
                "seconds": 0.0}
    t0 = time.perf_counter()
    result = mod.compute(trace, fast=fast)
    details: Any = None
    if name in ("overload", "1", "5"):
        details = mod.details(trace, fast=fast)
    entry = {"ours": result, "paper": getattr(mod, "PAPER", None), "details": details,
             "seconds": round(time.perf_counter() - t0, 2)}
    if hasattr(mod, "comparisons") and isinstance(details, dict):
        entry["compare"] = mod.comparisons(result, details)
    return entry


def plot_figure(name: str, entry: dict[str, Any], out_dir: Path, trace: Path,
                fast: bool) -> list[Path]:
    mod = figure_module(name)
    if mod is None or entry["ours"] is None:
        return []
    if name == "overload":
        return list(mod.plot(entry["ours"], out_dir, trace_path=trace, fast=fast))
    paths = list(mod.plot(entry["ours"], out_dir))
    if hasattr(mod, "plot_details") and isinstance(entry.get("details"), dict):
        paths += mod.plot_details(entry["details"], out_dir)
    return paths


def run_figures(names: Sequence[str], trace: Path, out_dir: Path | None,
                fast: bool) -> dict[str, dict[str, Any]]:
    """Compute (and, with ``out_dir``, plot) each figure; returns the report entries."""
    for name in names:  # every name and the output directory checked before any work
        check_figure(name)
    if not trace.exists():
        raise InputError(f"trace {trace} not found; pass --trace PATH")
    if out_dir is not None:
        ensure_dir(out_dir)
    report: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for k, name in enumerate(names, 1):
        print(f"[sim paper] figure {name} ({k}/{len(names)}), "
              f"{time.perf_counter() - started:.0f} s elapsed", file=sys.stderr, flush=True)
        entry = compute_figure(name, trace, fast)
        if out_dir is not None:
            entry["plots"] = [p.name for p in plot_figure(name, entry, out_dir, trace, fast)]
        report[name] = entry
    return report


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3g}"
    return str(v)


def gap(ours: Any, paper: Any) -> float | None:
    """(ours − paper) / paper, or None when either is not a number or paper is 0."""
    numbers = (int, float)
    if (isinstance(ours, bool) or isinstance(paper, bool) or not isinstance(ours, numbers)
            or not isinstance(paper, numbers) or paper == 0 or math.isnan(ours)):
        return None
    return (ours - paper) / paper


def _rows(ours: Any, paper: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    if isinstance(ours, dict):
        rows: list[tuple[str, str, str, str]] = []
        for k, v in ours.items():
            p = paper.get(k) if isinstance(paper, dict) else None
            if isinstance(v, list) and len(v) > 12:
                continue
            rows.extend(_rows(v, p, f"{prefix}{k}."))
        return rows
    g = gap(ours, paper)
    return [(prefix.rstrip("."), _fmt(paper), _fmt(ours), "—" if g is None else f"{100 * g:+.0f} %")]


def write_report(report: dict[str, dict[str, Any]], out_dir: Path, fast: bool) -> list[Path]:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; `InputError` if it cannot."""
    json_path, md_path = ensure_dir(out_dir) / "report.json", out_dir / "report.md"
    lines = ["# yuebing sim paper: reproduction of Mooncake (FAST'25) figures", "",
             f"Mode: {'fast (first requests only)' if fast else 'full conversation trace'}. "
             "See docs/reproduction.md for the set-up and every gap.", ""]
    for name, entry in report.items():
        lines += [f"## Figure {name}", ""]
        if entry["ours"] is None:
            lines += [f"Not available: {entry['details']}", ""]
            continue
        lines += ["| quantity | paper | yuebing sim | gap |", "|---|---|---|---|"]
        lines += [f"| {k} | {p} | {o} | {g} |"
                  for k, p, o, g in _rows(entry["ours"], entry["paper"])]
        compare = entry.get("compare")
        if isinstance(compare, dict):  # derived quantities a module compares (shares, ratios)
            lines += [f"| {k} | {p} | {o} | {g} |"
                      for k, p, o, g in _rows(compare["ours"], compare["paper"])]
        if isinstance(entry.get("details"), dict):
            lines += ["", "Details: `" + json.dumps(entry["details"], default=str)[:1500] + "`"]
        lines += [""] + [f"![{p}]({p})" for p in entry.get("plots", [])] + [""]
    try:
        json_path.write_text(strict_json(report, indent=1) + "\n")
        md_path.write_text("\n".join(lines) + "\n")
    except OSError as e:
        raise InputError(f"cannot write the report into '{out_dir}': {e.strerror or e}") from None
    return [json_path, md_path]
