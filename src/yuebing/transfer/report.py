"""Presenting `yuebing bench transfer` results: a rich table, JSON rows and PNG plots
(bandwidth vs request size, bandwidth vs lanes), drawn with matplotlib's Agg backend."""

from __future__ import annotations

import sys
from pathlib import Path

from yuebing.core.config import format_size
from yuebing.transfer.bench import Row


def print_table(rows: list[Row], title: str = "yuebing bench transfer") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("transport", "op", "size", "batch", "lanes", "GB/s", "p50 µs", "p99 µs",
                "µs/request", "CPU µs/req init+target", "vs memcpy", "vs raw (min-max)"):
        table.add_column(col, justify="right" if col not in ("transport", "op") else "left")
    for r in rows:
        ratio = r.extra.get("vs_memcpy")
        cpu = (f"{r.extra['cpu_us_initiator']:.1f}+{r.extra.get('cpu_us_target', 0):.1f}"
               if "cpu_us_initiator" in r.extra else "")
        table.add_row(r.transport, r.op, format_size(r.size_bytes), str(r.batch), str(r.lanes),
                      f"{r.gbps:.2f}", f"{r.p50_us:.0f}", f"{r.p99_us:.0f}",
                      f"{r.per_request_us:.1f}", cpu,
                      f"{ratio:.2f}" if isinstance(ratio, float) else "", _vs_raw(r))
    Console(width=None if sys.stdout.isatty() else 132).print(table)


def _vs_raw(r: Row) -> str:
    if "vs_raw" not in r.extra:
        return ""
    return f"{r.extra['vs_raw']:.2f} ({r.extra['vs_raw_min']:.2f}-{r.extra['vs_raw_max']:.2f})"


def plot(rows: list[Row], out_dir: Path, batch: int) -> list[Path]:
    """Write ``transfer_bw_vs_size.png`` and (with several lane counts) ``transfer_bw_vs_lanes.png``
    from the rows with at most ``batch`` requests per batch (plus memcpy)."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    main = [r for r in rows if r.batch <= batch or r.transport == "memcpy"]
    lanes_seen = sorted({r.lanes for r in main if r.transport == "tcp"})
    paths = [_plot_vs_size(main, out_dir / "transfer_bw_vs_size.png")]
    if len(lanes_seen) > 1:
        paths.append(_plot_vs_lanes(main, lanes_seen, out_dir / "transfer_bw_vs_lanes.png"))
    return paths


def _plot_vs_size(rows: list[Row], path: Path) -> Path:
    """One line per transport and op (TCP: the best lane count at each size)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    best: dict[tuple[str, str, int], Row] = {}
    for r in rows:
        key = (r.transport, r.op, r.size_bytes)
        if key not in best or r.gbps > best[key].gbps:
            best[key] = r
    series: dict[str, list[Row]] = {}
    for (transport, op, _), r in sorted(best.items()):
        label = "memcpy (1 thread, 256 MiB working set)" if transport == "memcpy" else (
            f"{transport} {op}" + (" (best lane count)" if transport == "tcp" else ""))
        series.setdefault(label, []).append(r)
    for label, rs in series.items():
        rs.sort(key=lambda r: r.size_bytes)
        ax.plot([r.size_bytes for r in rs], [r.gbps for r in rs], marker="o", label=label)
    sizes = sorted({r.size_bytes for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(s) for s in sizes])
    ax.set_xlabel("request size")
    ax.set_ylabel("GB/s")
    ax.set_title("transfer engine bandwidth vs request size (two processes)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_vs_lanes(rows: list[Row], lanes_seen: list[int], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in ("write", "read"):
        for size in sorted({r.size_bytes for r in rows if r.transport == "tcp"}):
            rs = sorted((r for r in rows if r.transport == "tcp" and r.op == op
                         and r.size_bytes == size), key=lambda r: r.lanes)
            if rs:
                ax.plot([r.lanes for r in rs], [r.gbps for r in rs], marker="o",
                        label=f"tcp {op} {format_size(size)}")
    ax.set_xlabel("TCP lanes per peer")
    ax.set_ylabel("GB/s")
    ax.set_xticks(lanes_seen)
    ax.set_title("TCP bandwidth vs lanes (two processes)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
