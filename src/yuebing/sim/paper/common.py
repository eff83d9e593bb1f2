"""Shared plumbing of the figure modules: cached simulation runs, progress, plotting helpers.

Life cycle: a figure's ``compute`` asks `run` for the `SimResult` of a `SimConfig` on a trace
(a file, or ``name:FILE`` for a workload a figure module registered with `register_workload`);
runs are memoised per (trace, config) for the life of the process, so ``yuebing sim paper``
simulates each distinct configuration once even when several figures use it. Long runs show a
rich progress bar on stderr (only when it is a terminal or ``progress=True``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from yuebing.sim.runner import SimResult, simulate
from yuebing.sim.system import SimConfig
from yuebing.sim.workload import SimRequest, from_trace_requests, load_requests
from yuebing.trace.model import Trace

log = logging.getLogger(__name__)

FAST_LIMIT = 2000
"""Requests replayed in ``--fast`` mode (the trace's first ~10 minutes)."""

_REQUESTS: dict[tuple[str, float, int], list[SimRequest]] = {}
_RESULTS: dict[tuple[str, SimConfig], SimResult] = {}
SHOW_PROGRESS: bool | None = None
"""None: show progress when stderr is a terminal."""


_BUILDERS: dict[str, Callable[[Path], Trace]] = {}


def register_workload(name: str, build: Callable[[Path], Trace]) -> None:
    """Make ``name:TRACE`` usable wherever a trace path is: the workload ``build(TRACE)``
    returns (a transformed or synthetic `Trace`, built once per process)."""
    _BUILDERS[name] = build


def workload_path(name: str, base: str | Path) -> str:
    """The trace-path string of registered workload ``name`` built from trace ``base``."""
    return f"{name}:{base}"


def requests(trace_path: str | Path, speed: float, limit: int) -> list[SimRequest]:
    """The requests of a trace file or of a registered workload (`workload_path`), replayed
    at ``speed``, the first ``limit`` of them (0: all); memoised."""
    key = (str(trace_path), speed, limit)
    if key not in _REQUESTS:
        name, sep, base = str(trace_path).partition(":")
        if sep and name in _BUILDERS:
            ordered = _BUILDERS[name](Path(base)).in_time_order()
            _REQUESTS[key] = from_trace_requests(ordered[:limit or None], speed)
        else:
            _REQUESTS[key] = load_requests(trace_path, speed=speed, limit=limit or None)
    return _REQUESTS[key]


def fast_config(config: SimConfig, fast: bool) -> SimConfig:
    """``config`` limited to `FAST_LIMIT` requests in fast mode."""
    return replace(config, limit=FAST_LIMIT) if fast and not config.limit else config


def run(trace_path: str | Path, config: SimConfig) -> SimResult:
    """The (memoised) result of simulating ``config`` on the trace."""
    key = (str(trace_path), config)
    cached = _RESULTS.get(key)
    if cached is not None:
        return cached
    reqs = requests(trace_path, config.speed, config.limit)
    label = (f"{config.system}/{config.policy.prefill_selector}/{config.policy.admission} "
             f"×{config.speed:g}")
    show = sys.stderr.isatty() if SHOW_PROGRESS is None else SHOW_PROGRESS
    if show:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task(label, total=len(reqs))
            result = simulate(reqs, config, progress=lambda n: bar.update(task, completed=n))
    else:
        result = simulate(reqs, config)
    log.info("%s: %d requests, %d events, %.1f s", label, len(reqs), result.events, result.wall_s)
    _RESULTS[key] = result
    return result


def clear_cache() -> None:
    _RESULTS.clear()
    _REQUESTS.clear()


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_dir: str | Path, name: str) -> Path:
    """Lay out ``fig``, write it as ``out_dir/name`` (PNG, 120 dpi), close it; the path."""
    fig.tight_layout()
    path = Path(out_dir) / name
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def paired_bars(names: Sequence[str], ours: Mapping[str, float], paper: Mapping[str, float],
                ylabel: str, title: str, size: tuple[float, float]) -> Any:
    """A figure of our value beside the paper's for each name (x labels wrap at ``_``)."""
    fig, ax = pyplot().subplots(figsize=size)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [ours[n] for n in names], 0.4, label="yuebing sim")
    ax.bar([x + 0.2 for x in xs], [paper[n] for n in names], 0.4, label="paper")
    ax.set_xticks(list(xs), [n.replace("_", "\n") for n in names])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return fig
