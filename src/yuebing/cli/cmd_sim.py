"""``yuebing sim run`` (one system, one configuration) and ``yuebing sim paper`` (the report).

Both replay a Mooncake trace through the discrete-event simulator (`yuebing.sim`); flags of
``sim run`` are generated from `yuebing.sim.system.SimConfig`. Bad input (unreadable or
malformed trace, unknown names, bad numbers, an output path that cannot be written) exits with
status 2 and a message before any simulation runs. JSON output (``--json``, ``--records``) is
standard JSON: a value that does not exist (e.g. the mean TTFT when nothing completed) is null.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from yuebing.cli.main import Command
from yuebing.core.config import add_config_args, config_from_args
from yuebing.core.errors import InputError

if TYPE_CHECKING:
    from yuebing.sim.metrics import RequestRecord

_DEFAULT_TRACE = Path("..") / "shared" / "traces" / "conversation_trace.jsonl"
SIM_ALIASES = {"--prefill-policy": "prefill_selector", "--decode-policy": "decode_selector",
               "--balancing-threshold": "kvcache_balancing_threshold"}
"""``sim run``'s names for three of the policy's flags (the paper's words)."""


def _add_run(p: argparse.ArgumentParser) -> None:
    from yuebing.sim.system import SimConfig

    p.add_argument("trace", nargs="?", type=Path, default=_DEFAULT_TRACE,
                   help=f"Mooncake JSONL trace (default: {_DEFAULT_TRACE})")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--records", type=Path, default=None,
                   help="also write one JSON line per request to this file")
    add_config_args(p, SimConfig)
    for flag, dest in SIM_ALIASES.items():
        p.add_argument(flag, dest=dest, default=None, help=f"same as --{dest.replace('_', '-')}",
                       type=float if dest.endswith("threshold") else str)


def _check_out_file(path: Path | None, flag: str) -> None:
    """Fail before any work when ``path``'s directory does not exist (nothing is written)."""
    if path is not None and not path.parent.is_dir():
        raise InputError(f"{flag} {str(path)!r}: directory '{path.parent}' does not exist")


def _write_records(path: Path, records: Sequence[RequestRecord]) -> None:
    """One JSON line per request, written to a temporary file and renamed into place."""
    from yuebing.sim.paper.report import strict_json

    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w") as fh:
            for r in records:
                fh.write(strict_json({
                    "index": r.index, "arrival_s": r.arrival_s, "ttft_s": r.ttft_s,
                    "tbt_s": r.tbt_s, "tbt_p90_s": r.tbt_p90_s, "tbt_mean_s": r.tbt_mean_s,
                    "queue_s": r.queue_s, "prefill_s": r.prefill_s, "transfer_s": r.transfer_s,
                    "decode_wait_s": r.decode_wait_s, "hit_tokens": r.hit_tokens,
                    "prefill_gpu_s": r.prefill_gpu_s, "prefill_id": r.prefill_id,
                    "decode_id": r.decode_id,
                    "rejected": None if r.rejected is None else r.rejected.name.lower(),
                    "reject_reason": r.reject_reason}) + "\n")
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write --records {str(path)!r}: {e.strerror or e}") from None


def _run(ns: argparse.Namespace) -> int:
    from dataclasses import asdict

    from yuebing.sim.paper.common import requests, run
    from yuebing.sim.paper.report import strict_json
    from yuebing.sim.system import SimConfig

    config = config_from_args(SimConfig, ns)
    _check_out_file(ns.records, "--records")
    result = run(ns.trace, config)
    reqs = requests(ns.trace, config.speed, config.limit)
    out = {"config": asdict(config), "summary": result.summary, "events": result.events,
           "wall_s": round(result.wall_s, 3), "events_per_s": round(result.events /
                                                                    max(result.wall_s, 1e-9)),
           "simulated_s": round(result.sim_end_s, 3), "requests": len(reqs)}
    if ns.records is not None:
        _write_records(ns.records, result.records)
    if ns.json:
        print(strict_json(out))
    else:
        s = result.summary
        print(f"{config.system}: {s['completed']}/{s['requests']} completed, "
              f"{s['rejected']} rejected; mean TTFT {s['ttft_s']['mean']:.2f} s; "  # type: ignore[index]
              f"effective capacity {s['effective_capacity']}; hit rate {s['hit_rate']:.3f}; "
              f"{result.events} events in {result.wall_s:.2f} s")
    return 0


def _add_paper(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=_DEFAULT_TRACE,
                   help=f"conversation trace (default: {_DEFAULT_TRACE})")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for PNGs + report.json + report.md (default: reports/paper "
                        "when no --figure is given)")
    p.add_argument("--figure", default=None,
                   help="run one figure: 1, 5, 8, 9, 10, 11, 14, 15, overload or longctx")
    p.add_argument("--fast", action="store_true", help="replay only the first 2000 requests")
    p.add_argument("--json", action="store_true", help="print the result(s) as JSON")


def _paper(ns: argparse.Namespace) -> int:
    from yuebing.sim.paper import common
    from yuebing.sim.paper.report import FIGURES, run_figures, strict_json, write_report

    names = [ns.figure] if ns.figure is not None else list(FIGURES)
    out_dir = ns.out if ns.out is not None or ns.figure is not None else Path("reports") / "paper"
    common.SHOW_PROGRESS = sys.stderr.isatty()
    report = run_figures(names, ns.trace, out_dir, ns.fast)
    if out_dir is not None:
        paths = write_report(report, out_dir, ns.fast)
        if not ns.json:
            print("wrote " + ", ".join(str(p) for p in paths))
    if ns.json:
        body = report[ns.figure]["ours"] if ns.figure is not None else {
            k: v["ours"] for k, v in report.items()}
        print(strict_json(body))
    elif ns.figure is not None:
        print(strict_json(report[ns.figure]["ours"], indent=1))
    return 0


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", type=Path, default=_DEFAULT_TRACE,
                   help=f"Mooncake JSONL trace (default: {_DEFAULT_TRACE})")
    p.add_argument("--systems", default="mooncake,vllm,vllm_prefix_caching,vllm_chunked_prefill",
                   help="comma-separated systems to time")
    p.add_argument("--repeat", type=int, default=1, help="runs per system (fastest is kept)")
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of wall time per system")
    p.add_argument("--json", action="store_true", help="print JSON")


def _bench(ns: argparse.Namespace) -> int:
    from yuebing.sim.bench import check_bench_args, plot_bench, run_bench
    from yuebing.sim.paper.report import ensure_dir, strict_json

    systems = [s.strip() for s in ns.systems.split(",") if s.strip()]
    check_bench_args(systems, ns.repeat, ns.limit)  # before creating the --plot directory
    if ns.plot is not None:
        ensure_dir(ns.plot.parent)
    result = run_bench(ns.trace, systems, repeat=ns.repeat, limit=ns.limit)
    if ns.plot is not None:
        plot_bench(result, ns.plot)
    if ns.json:
        print(strict_json(result))
    else:
        for name, r in result.items():
            print(f"{name:22s} {r['wall_s']:7.2f} s wall {r['cpu_s']:7.2f} s CPU  "
                  f"{r['events']:>9d} events  "
                  f"{r['events_per_s']:>9.0f} events/s  {r['requests_per_s']:>6.0f} req/s  "
                  f"{'OK' if r['meets_target'] else 'SLOWER THAN 20 s'}"
                  + (f"  ({r['decode_iterations']} decode iterations, "
                     f"{r['iterations_per_s']:.0f}/s)" if "decode_iterations" in r else ""))
    return 0


COMMANDS = [
    Command(("sim", "run"), "simulate one system on a trace", _add_run, _run),
    Command(("sim", "paper"), "reproduce the Mooncake paper's figures", _add_paper, _paper),
    Command(("bench", "sim"), "time the simulator on a whole trace, per system", _add_bench,
            _bench),
]
