"""``yuebing bench transfer``: two-process bandwidth/latency of the transfer engine (shared
memory and TCP; read and write; request sizes, batch and lane counts), as a table, ``--json``
rows {transport, op, size_bytes, batch, lanes, gbps, p50_us, p99_us, ...}, and PNG plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from yuebing.cli.main import Command
from yuebing.core.config import parse_size, parse_size_list
from yuebing.core.errors import ConfigError

if TYPE_CHECKING:
    from yuebing.transfer.bench import BenchConfig, Row


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=parse_size_list, default="64KiB,1MiB,4MiB,16MiB,64MiB",
                   help="request sizes (default: 64KiB,1MiB,4MiB,16MiB,64MiB)")
    p.add_argument("--batch", type=int, default=16, help="requests per batch (default 16)")
    p.add_argument("--lanes", type=_ints, default=(-1,),
                   help="TCP lane counts, e.g. 1,2,4,8 (default -1: this machine's choice)")
    p.add_argument("--ops", type=_words, default=("write", "read"), help="write,read")
    p.add_argument("--transports", type=_words, default=("tcp", "shm"), help="tcp,shm")
    p.add_argument("--duration", type=float, default=1.0, help="seconds per cell (default 1)")
    p.add_argument("--small-batch", type=int, default=128,
                   help="also run 64KiB requests in batches of this many (0 = skip)")
    p.add_argument("--slice-size", type=parse_size, default=1 << 20, help="TCP slice size")
    p.add_argument("--socket-buffer", type=parse_size, default=4 << 20,
                   help="SO_SNDBUF/SO_RCVBUF per lane (0 = kernel auto-tuning)")
    p.add_argument("--max-inflight", type=parse_size, default=256 << 20,
                   help="cap of bytes per batch (large sizes use smaller batches)")
    p.add_argument("--no-memcpy", action="store_true", help="skip the memcpy reference")
    p.add_argument("--raw", type=int, default=0, metavar="ROUNDS",
                   help="TCP cells alternate with a raw Python socket RPC of one request's size "
                        "in ROUNDS rounds (row: vs_raw median ratio, vs_raw_min/max; 0 = off)")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows")
    p.add_argument("--plot", type=Path, default=None, help="write PNG plots into this folder")


def _run(ns: argparse.Namespace) -> int:
    from yuebing.transfer.bench import BenchConfig
    from yuebing.transfer.report import plot, print_table

    sizes = ns.sizes if isinstance(ns.sizes, list) else parse_size_list(ns.sizes)
    try:
        cfg = BenchConfig(sizes=tuple(sizes), batch=ns.batch, lanes=tuple(ns.lanes),
                          ops=tuple(ns.ops), transports=tuple(ns.transports),
                          duration_s=ns.duration, small_batch=ns.small_batch,
                          slice_size=ns.slice_size, socket_buffer=ns.socket_buffer,
                          max_inflight=ns.max_inflight, memcpy=not ns.no_memcpy,
                          raw_rounds=ns.raw)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    rows = _measure(cfg)
    if ns.json:
        print(json.dumps([r.as_json() for r in rows]))
    else:
        print_table(rows)
    if ns.plot is not None:
        for path in plot(rows, ns.plot, cfg.batch):
            if not ns.json:
                print(f"wrote {path}")
    return 0


def _measure(cfg: BenchConfig) -> list[Row]:
    """Run the bench with a progress bar on stderr (stdout stays clean for ``--json``)."""
    from rich.console import Console
    from rich.progress import Progress

    from yuebing.transfer.bench import run_bench

    total = len(cfg.cells()) + (1 if cfg.memcpy else 0)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("bench transfer", total=total)
        rows = run_bench(cfg, lambda label: progress.update(task, advance=1, description=label))
    return rows


COMMANDS = [Command(("bench", "transfer"),
                    "transfer engine bandwidth/latency between two processes (shm, tcp)",
                    _add, _run)]
