"""Reproductions of the FAST'25 Mooncake paper's figures (``yuebing sim paper``).

Each figure module exposes ``PAPER`` (the paper's numbers, ``None`` where we could not find
one), ``compute(trace_path, fast=False) -> dict`` (JSON-ready, keyed by the paper's names) and
``plot(result, out_dir) -> list[Path]``. `yuebing.sim.paper.report` runs them and writes the
PNGs, report.json and report.md.
"""
