"""``yuebing bench serve``: replay a Mooncake trace (or a synthetic workload) against any
OpenAI-compatible endpoint and report SLO attainment, goodput and latency (`yuebing.bench`).

Flags come from `yuebing.bench.config.BenchConfig`; the workload is a trace file or ``--synth
fixed|docqa``. Options, output paths, the trace, every prompt and the endpoint are checked
before any load; a problem exits 2 with one line. ``--json`` prints one object (``config``,
``model``, ``workload``, ``summary``; with ``--sweep-rates`` also ``sweep`` and ``max_rate``).
Ctrl-C drops the requests in flight, reports those answered (``"interrupted": true``), exit 130.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yuebing.cli.main import Command
from yuebing.core.config import add_config_args, config_from_args, require
from yuebing.core.errors import ConfigError

if TYPE_CHECKING:
    from yuebing.bench.config import BenchConfig
    from yuebing.bench.workload import BenchRequest
    from yuebing.trace.model import Trace

_SYNTH_PREFIX = {"fixed": "fixed_", "docqa": "docqa_"}
_PROMPT_FIELDS = ("low", "high", "seed")


def _add_serve(p: argparse.ArgumentParser) -> None:
    from yuebing.bench.config import BenchConfig
    from yuebing.trace.prompts import PromptSynthesizer
    from yuebing.trace.synth import WORKLOADS

    p.add_argument("trace", nargs="?", type=Path, default=None,
                   help="Mooncake JSONL trace to replay (or give --synth)")
    p.add_argument("--synth", choices=sorted(_SYNTH_PREFIX), default=None,
                   help="replay a synthetic workload instead of a trace")
    p.add_argument("--sweep-rates", default=None, metavar="R1,R2,...",
                   help="one Poisson run per rate (requests/s); reports the largest rate "
                        "reaching --target-attainment")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="write TTFT/TBT CDFs (and, for a sweep, attainment vs rate) PNGs here")
    p.add_argument("--records", type=Path, default=None,
                   help="write one JSON line per request to this file")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar on stderr (default: when stderr is a terminal)")
    add_config_args(p, BenchConfig)
    add_config_args(p, PromptSynthesizer, prefix="prompt_", only=_PROMPT_FIELDS)
    for kind, prefix in _SYNTH_PREFIX.items():
        add_config_args(p.add_argument_group(f"--synth {kind}"),  # type: ignore[arg-type]
                        WORKLOADS.get(kind)[0], prefix=prefix)


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2"`` → [0.5, 1.0, 2.0]; each rate a positive number, no repeats."""
    try:
        rates = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--sweep-rates takes numbers such as 0.5,1,2, got {text!r}") from None
    require(bool(rates), f"--sweep-rates names no rate: {text!r}")
    require(all(math.isfinite(r) and r > 0 for r in rates),
            f"--sweep-rates must all be > 0 requests/s, got {text!r}")
    require(len(set(rates)) == len(rates), f"--sweep-rates repeats a rate: {text!r}")
    return sorted(rates)


def _load_workload(ns: argparse.Namespace) -> Trace:
    from yuebing.trace.io import load_trace
    from yuebing.trace.synth import WORKLOADS

    for kind, prefix in _SYNTH_PREFIX.items():
        if kind != ns.synth:
            given = [n for n, v in vars(ns).items() if n.startswith(prefix) and v is not None]
            if given:
                raise ConfigError(f"--{given[0].replace('_', '-')} applies only to --synth "
                                  f"{kind}")
    require((ns.trace is None) != (ns.synth is None),
            "give a trace file or --synth fixed|docqa (exactly one)")
    if ns.trace is not None:
        return load_trace(ns.trace)
    cls, generate = WORKLOADS.get(ns.synth)
    return generate(config_from_args(cls, ns, prefix=_SYNTH_PREFIX[ns.synth]))


def _progress(show: bool) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True, disable=not show)


def _run_all(cfg: BenchConfig, workloads: Sequence[tuple[float | None, Any]],
             show: bool) -> tuple[str, list[Any]]:
    from yuebing.bench.result import Status
    from yuebing.bench.runner import run_bench, run_label

    with _progress(show) as bar:
        state: dict[str, Any] = {}

        def on_start(rate: float | None, n: int) -> None:
            state["task"] = bar.add_task(run_label(cfg, rate), total=n, status="")
            state["counts"] = dict.fromkeys(Status, 0)

        def on_done(res: Any) -> None:
            counts = state["counts"]
            counts[res.status] += 1
            bar.update(state["task"], advance=1, status=(
                f"ok {counts[Status.OK]} 429 {counts[Status.REJECTED]} "
                f"err {counts[Status.ERROR]}"))

        return run_bench(cfg, workloads, on_start, on_done)


def _run_serve(ns: argparse.Namespace) -> int:
    from yuebing.bench.config import BenchConfig
    from yuebing.bench.report import (
        check_out_paths,
        plot_all,
        print_tables,
        report,
        strict_json,
        write_records,
    )
    from yuebing.bench.workload import build_workload, sweep_workloads
    from yuebing.trace.prompts import PromptSynthesizer

    cfg = config_from_args(BenchConfig, ns)
    synth = config_from_args(PromptSynthesizer, ns, prefix="prompt_")
    rates = parse_rates(ns.sweep_rates) if ns.sweep_rates is not None else None
    if rates is not None:
        require(cfg.rate == 0 and cfg.concurrency == 0 and cfg.speed == 1.0,
                "--sweep-rates sets the rate of each run; drop --rate / --concurrency / --speed")
    require(rates is not None or not (cfg.sweep_down or cfg.stop_on_miss),
            "--sweep-down and --stop-on-miss order and stop the runs of --sweep-rates; give it")
    check_out_paths(ns.records, ns.plot)
    trace = _load_workload(ns)
    workloads: Sequence[tuple[float | None, list[BenchRequest]]] = (
        sweep_workloads(trace, cfg, synth, rates) if rates
        else [(cfg.rate or None, build_workload(trace, cfg, synth))])
    show = ns.progress if ns.progress is not None else sys.stderr.isatty()
    model, runs = _run_all(cfg, workloads, show)
    rep = report(cfg, model, trace.source, runs, sweep=rates is not None)
    if ns.records is not None:
        write_records(ns.records, runs)
    if ns.json:
        print(strict_json(rep), flush=True)
    else:
        print_tables(rep, runs, cfg)
    if ns.plot is not None:  # last: a plot that cannot be written loses no result
        plot_all(ns.plot, runs, cfg, sweep=rates is not None)
    return 130 if rep.get("interrupted") else 0


COMMANDS = [
    Command(("bench", "serve"),
            "replay a trace against an OpenAI-compatible endpoint: TTFT/TBT, SLO attainment, "
            "goodput, rate sweeps", _add_serve, _run_serve),
]


def _add_instance(p: argparse.ArgumentParser) -> None:
    from yuebing.instance.bench import InstanceBenchConfig

    add_config_args(p, InstanceBenchConfig)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _run_instance(ns: argparse.Namespace) -> int:
    import json

    from rich.progress import Progress

    from yuebing.instance.bench import InstanceBenchConfig, run_bench

    cfg = config_from_args(InstanceBenchConfig, ns)
    with Progress(transient=True, disable=ns.json) as bar:
        task = bar.add_task("bench instance", total=None)
        report = run_bench(cfg, lambda s: bar.update(task, description=s))
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:>32}  {value}")
    return 0


COMMANDS.append(Command(
    ("bench", "instance"), "prefill/decode instances on real processes: store-hit vs cold TTFT, "
    "layer-wise hand-off, decode step beside a busy prefill, store -> pool load rate",
    _add_instance, _run_instance))
