"""``yuebing trace ...``: inspect, transform and generate Mooncake traces.

Report commands (stats, hit-rate) print a rich table, or with ``--json`` one JSON object on
stdout. Transform and generate commands (scale, retime, filter, synth) write a new JSONL trace
to ``--out`` and print what they wrote (``--json``: ``{"out": path, "requests": n}``);
``prompts`` writes one ``{"index", "timestamp", "output_length", "prompt_token_ids"}`` line per
request (`yuebing.trace.prompts`), for replaying a trace against a real server.
The ``hit-rate --json`` contract: an object mapping each capacity in tokens, as an integer
string (``"1000000"``; ``"inf"`` for an unbounded cache), to the token-weighted hit rate.
Bad input (unreadable or malformed trace, bad option values) exits with status 2 and a message
naming the problem; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from yuebing.cli.main import Command
from yuebing.core.config import add_config_args, config_from_args, parse_size, require
from yuebing.core.errors import InputError


def _trace_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL trace file")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _out_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="where to write the resulting JSONL trace")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=None, sort_keys=False))


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


# --- stats -------------------------------------------------------------------------------

def _run_stats(ns: argparse.Namespace) -> int:
    import msgspec

    from yuebing.trace.io import load_trace
    from yuebing.trace.stats import trace_stats

    st = trace_stats(load_trace(ns.trace))
    if ns.json:
        _print_json(msgspec.to_builtins(st))
        return 0
    rate = "n/a" if st.arrival_rate_per_s is None else f"{st.arrival_rate_per_s:.3f}"
    rows = [["requests", f"{st.requests:,}"], ["duration (s)", f"{st.duration_s:,.3f}"],
            ["arrival rate (req/s)", rate],
            ["blocks / unique", f"{st.blocks:,} / {st.unique_blocks:,}"],
            ["cache ratio", f"{st.cache_ratio:.4f}"], ["out-of-order lines", str(st.out_of_order)]]
    for name, ls in (("input", st.input), ("output", st.output)):
        rows.append([f"{name} mean / p50 / p90 / p99",
                     f"{ls.mean:,.1f} / {ls.p50:,.0f} / {ls.p90:,.0f} / {ls.p99:,.0f}"])
        rows.append([f"{name} min / max / total", f"{ls.min:,} / {ls.max:,} / {ls.total:,}"])
    _table(f"trace {ns.trace}", ["statistic", "value"], rows)
    return 0


# --- hit-rate ----------------------------------------------------------------------------

def parse_capacities(text: str) -> list[float]:
    """``"1e6,3e6,16Mi,inf"`` → [1e6, 3e6, 16·2**20, inf] tokens (k/M/G, Ki/Mi/Gi suffixes)."""
    out: list[float] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item.lower() in ("inf", "unbounded"):
            out.append(math.inf)
            continue
        if item[-1] in "iI":  # token counts: "16Mi" means 16·2**20 like "16MiB"
            item += "B"
        out.append(float(parse_size(item)))
    require(bool(out), f"no capacity in {text!r}; give e.g. --capacity 1e6,3e6")
    return out


def _add_hit_rate(p: argparse.ArgumentParser) -> None:
    _trace_arg(p)
    p.add_argument("--capacity", required=True,
                   help="comma-separated total cache capacities in tokens, e.g. 1e6,3e6,inf")
    p.add_argument("--local", type=int, default=None, metavar="N",
                   help="N local caches of capacity/N tokens each instead of one global cache")
    p.add_argument("--routing", default=None,
                   help="routing rule for --local: round_robin (default), random, or cache_aware "
                        "(longest prefix; ties to least loaded, lowest index)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random routing rule")


def _run_hit_rate(ns: argparse.Namespace) -> int:
    from yuebing.trace.hitrate import ROUTERS, capacity_key, hit_rate_curve
    from yuebing.trace.io import load_trace

    capacities = parse_capacities(ns.capacity)
    if ns.local is None:
        require(ns.routing is None, "--routing applies only to --local N caches; add --local N")
    else:
        ns.routing = ns.routing or "round_robin"
        require(ns.local >= 1, f"--local must be >= 1, got {ns.local}")
        require(ns.seed >= 0, f"--seed must be >= 0, got {ns.seed}")
        ROUTERS.get(ns.routing)
    trace = load_trace(ns.trace)
    if ns.local is None:
        results = hit_rate_curve(trace, capacities)
    else:
        results = hit_rate_curve(trace, capacities, ns.local, ns.routing, ns.seed)
    if ns.json:
        _print_json({capacity_key(r.capacity_tokens): r.hit_rate for r in results})
        return 0
    where = "1 global cache" if ns.local is None else f"{ns.local} local caches ({ns.routing})"
    rows = [[capacity_key(r.capacity_tokens), capacity_key(r.capacity_blocks_per_cache),
             f"{r.hit_tokens:,}", f"{r.input_tokens:,}", f"{r.hit_rate:.4f}"] for r in results]
    _table(f"prefix-cache hit rate, {where}, {len(trace):,} requests",
           ["capacity (tokens)", "blocks/cache", "hit tokens", "input tokens", "hit rate"], rows)
    return 0


# --- transforms --------------------------------------------------------------------------

def _report_written(ns: argparse.Namespace, trace: Any) -> int:
    from yuebing.trace.io import write_trace

    # `load_trace` rejects a file without requests, so never write one
    require(len(trace) > 0, f"no request is left to write to {ns.out!r}; widen the filter")
    path = write_trace(trace, ns.out)
    if ns.json:
        _print_json({"out": str(path), "requests": len(trace)})
    else:
        print(f"wrote {len(trace):,} requests to {path}")
    return 0


def _add_scale(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL trace file")
    _out_arg(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--time-factor", type=float, default=None,
                   help="multiply timestamps by this (0.5 = twice as fast)")
    g.add_argument("--speed", type=float, default=None, help="replay speed-up (2 = twice as fast)")
    p.add_argument("--input-factor", type=float, default=1.0, help="multiply prompt lengths")
    p.add_argument("--output-factor", type=float, default=1.0, help="multiply output lengths")


def _run_scale(ns: argparse.Namespace) -> int:
    from yuebing.trace.io import load_trace
    from yuebing.trace.transform import scale_lengths, scale_time

    if ns.speed is not None:
        require(math.isfinite(ns.speed) and ns.speed > 0, f"--speed must be > 0, got {ns.speed}")
    factor = ns.time_factor if ns.time_factor is not None else (
        1.0 / ns.speed if ns.speed is not None else 1.0)
    trace = load_trace(ns.trace)
    trace = scale_lengths(scale_time(trace, factor), ns.input_factor, ns.output_factor)
    return _report_written(ns, trace)


def _add_retime(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL trace file")
    _out_arg(p)
    p.add_argument("--rate", type=float, required=True, help="Poisson arrival rate, requests/s")
    p.add_argument("--seed", type=int, default=0, help="random seed")


def _run_retime(ns: argparse.Namespace) -> int:
    from yuebing.trace.io import load_trace
    from yuebing.trace.transform import retime_poisson

    require(math.isfinite(ns.rate) and ns.rate > 0, f"--rate must be > 0, got {ns.rate}")
    require(ns.seed >= 0, f"--seed must be >= 0, got {ns.seed}")
    return _report_written(ns, retime_poisson(load_trace(ns.trace), ns.rate, ns.seed))


_FILTER_INTS = ("start_ms", "end_ms", "min_input", "max_input", "min_output", "max_output",
                "limit")


def _add_filter(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL trace file")
    _out_arg(p)
    helps = {"start_ms": "keep timestamps >= this (ms)", "end_ms": "keep timestamps < this (ms)",
             "min_input": "minimum prompt tokens", "max_input": "maximum prompt tokens",
             "min_output": "minimum output tokens", "max_output": "maximum output tokens",
             "limit": "keep only the first N matching requests (timestamp order)"}
    for name in _FILTER_INTS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=helps[name])
    p.add_argument("--rebase", action="store_true", help="shift timestamps to start at 0")


def _run_filter(ns: argparse.Namespace) -> int:
    from yuebing.trace.io import load_trace
    from yuebing.trace.transform import filter_trace

    kwargs = {name: getattr(ns, name) for name in _FILTER_INTS}
    trace = load_trace(ns.trace)
    return _report_written(ns, filter_trace(trace, rebase=ns.rebase, **kwargs))


# --- prompts -----------------------------------------------------------------------------

def _add_prompts(p: argparse.ArgumentParser) -> None:
    from yuebing.trace.prompts import PromptSynthesizer

    p.add_argument("trace", help="Mooncake JSONL trace file")
    _out_arg(p)
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    add_config_args(p, PromptSynthesizer)


def _run_prompts(ns: argparse.Namespace) -> int:
    import msgspec

    from yuebing.trace.io import load_trace
    from yuebing.trace.prompts import PromptSynthesizer

    require(ns.limit is None or ns.limit >= 0, f"--limit must be >= 0, got {ns.limit}")
    synth = config_from_args(PromptSynthesizer, ns)
    trace = load_trace(ns.trace)
    require(synth.block_size == trace.block_size,
            f"--block-size {synth.block_size} differs from the trace's {trace.block_size}")
    requests = trace.requests[: ns.limit]
    enc = msgspec.json.Encoder()
    tmp = Path(ns.out + ".tmp")
    try:
        with tmp.open("wb") as f:
            for i, r in enumerate(requests):
                f.write(enc.encode({"index": i, "timestamp": r.timestamp,
                                    "output_length": r.output_length,
                                    "prompt_token_ids": synth.tokens(r, salt=i)}) + b"\n")
        tmp.replace(ns.out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write prompts to {ns.out!r}: {e.strerror or e}") from None
    if ns.json:
        _print_json({"out": ns.out, "requests": len(requests)})
    else:
        print(f"wrote {len(requests):,} prompts to {ns.out}")
    return 0


# --- synth -------------------------------------------------------------------------------

def _synth_command(kind: str, help_text: str) -> Command:
    from yuebing.trace.synth import WORKLOADS

    cls, generate = WORKLOADS.get(kind)

    def add(p: argparse.ArgumentParser) -> None:
        _out_arg(p)
        add_config_args(p, cls)

    def run(ns: argparse.Namespace) -> int:
        return _report_written(ns, generate(config_from_args(cls, ns)))

    return Command(("trace", "synth", kind), help_text, add, run)


COMMANDS = [
    Command(("trace", "stats"), "request/length/arrival statistics and cache ratio of a trace",
            _trace_arg, _run_stats),
    Command(("trace", "hit-rate"), "prefix-cache hit rate vs capacity (global or N local caches)",
            _add_hit_rate, _run_hit_rate),
    Command(("trace", "scale"), "scale a trace's time and/or lengths", _add_scale, _run_scale),
    Command(("trace", "retime"), "give a trace seeded Poisson arrivals", _add_retime, _run_retime),
    Command(("trace", "filter"), "keep requests in a time window / length range",
            _add_filter, _run_filter),
    Command(("trace", "prompts"), "token-id prompts realizing the trace's prefix sharing (JSONL)",
            _add_prompts, _run_prompts),
    _synth_command("fixed", "fixed-length prompts with a shared-prefix fraction"),
    _synth_command("docqa", "long documents, each followed by many questions"),
]
