"""``yuebing bench store`` (filled in below)."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")


def run_bench(ns: argparse.Namespace) -> int:
    raise SystemExit("not yet")
