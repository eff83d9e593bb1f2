"""Compare ``yuebing bench store --json`` rows with the original Mooncake Store's summaries
(../shared/peers/mooncake_store_bench.py JSON lines) and plot them.

    python benchmarks/store_compare.py OUTDIR [--img docs/img]

OUTDIR holds one folder per value size (as store_vs_mooncake.sh writes), each with
yuebing_store.json and mc/mooncake_store_{remote_tcp,single_memcpy}.jsonl; metadata-op cells
come from the first folder that has them (both systems). With several rounds (OUTDIR/r1,
OUTDIR/r2, ...: the two systems took turns per size in each round) every cell is the median of
its rounds on each side, and the table also gives the lowest and highest per-round ratio.
Prints a markdown table (ours, original, ratio) and writes PNG plots.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OPS = {"put": "put", "get": "get", "batch_put": "put_batch", "batch_get": "get_batch",
       "put_from": "put_from", "get_into": "get_into", "batch_put_from": "batch_put_from",
       "batch_get_into": "batch_get_into", "put_4k": "put_small", "get_4k": "get_small",
       "exists_hit": "is_exist_hit", "exists_miss": "is_exist_miss",
       "batch_exists": "batch_is_exist16", "remove": "remove"}
META = {"put_4k", "get_4k", "exists_hit", "exists_miss", "batch_exists", "remove"}
VARIANT = {"remote_tcp": "remote_tcp", "same_host": "single_memcpy"}


def load_mc(out: Path) -> dict[tuple[str, str, int], dict]:
    cells: dict[tuple[str, str, int], dict] = {}
    for path in sorted(out.glob("*/mc/mooncake_store_*.jsonl"), key=_size_order):
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                o = json.loads(line)
                if o.get("kind") == "summary":
                    cells.setdefault((o["variant"], o["op"], o["size"]), o)
    return cells


def _size_order(p: Path) -> int:
    from yuebing.core.config import parse_size

    folder = p.parts[len(p.parts) - 3] if p.name.endswith(".jsonl") else p.parent.name
    return parse_size(folder)


def rows(out: Path) -> list[dict]:
    ours = [r for p in sorted(out.glob("*/yuebing_store.json"), key=_size_order)
            for r in json.loads(p.read_text())]
    mc = load_mc(out)
    table = []
    for r in ours:
        meta = r["op"] in META
        size = 4096 if r["op"] in ("put_4k", "get_4k") else (0 if meta else r["size_bytes"])
        o = mc.get((VARIANT[r["path"]], OPS[r["op"]], size))
        mine = r["ops_per_s"] if meta else r["gbps"]
        theirs = None if o is None else (o["obj_per_s_median"] if meta else o["GBps_median"])
        table.append({**r, "metric": "ops/s" if meta else "GB/s", "ours": mine,
                      "original": theirs, "ratio": (mine / theirs) if theirs else None})
    return table


def rounds(out: Path) -> list[Path]:
    """The round folders of ``out`` (r1, r2, ...), or ``out`` itself for a single round."""
    found = sorted((p for p in out.glob("r[0-9]*") if p.is_dir()), key=lambda p: int(p.name[1:]))
    return found or [out]


def merged(out: Path) -> list[dict]:
    """`rows` of every round, each cell the median over rounds of ours and of the original's
    (the ratio is the ratio of those medians); ``ratio_min`` / ``ratio_max``: per-round range."""
    per = [rows(r) for r in rounds(out)]
    key = lambda t: (t["path"], t["op"], t["size_bytes"], t["batch"])  # noqa: E731
    cells: dict[tuple, list[dict]] = {}
    for table in per:
        for t in table:
            cells.setdefault(key(t), []).append(t)
    table = []
    for ts in cells.values():
        ours = statistics.median(t["ours"] for t in ts)
        theirs_l = [t["original"] for t in ts if t["original"]]
        theirs = statistics.median(theirs_l) if theirs_l else None
        ratios = [t["ratio"] for t in ts if t["ratio"]]
        table.append({**ts[0], "ours": ours, "original": theirs, "rounds": len(ts),
                      "ratio": ours / theirs if theirs else None,
                      "ratio_min": min(ratios) if ratios else None,
                      "ratio_max": max(ratios) if ratios else None})
    return table


def markdown(table: list[dict]) -> str:
    spread = any(t.get("rounds", 1) > 1 for t in table)
    head = "| path (original variant) | op | size | batch | metric | yuebing | original | ratio |"
    lines = [head + (" per-round ratios |" if spread else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if spread else "")]
    for t in table:
        size = f"{t['size_bytes'] // 1024} KiB" if t["size_bytes"] else "-"
        orig = "-" if t["original"] is None else f"{t['original']:.3g}"
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        line = (f"| {t['path']} ({VARIANT[t['path']]}) | {t['op']} | {size} | {t['batch']} "
                f"| {t['metric']} | {t['ours']:.3g} | {orig} | {ratio} |")
        if spread:
            lo, hi = t.get("ratio_min"), t.get("ratio_max")
            line += " - |" if lo is None else f" {lo:.2f}–{hi:.2f}x |"
        lines.append(line)
    return "\n".join(lines)


def plot(table: list[dict], img: Path) -> list[Path]:
    img.mkdir(parents=True, exist_ok=True)
    made = []
    for path in ("remote_tcp", "same_host"):
        data = [t for t in table if t["path"] == path and t["metric"] == "GB/s"]
        if not data:
            continue
        ops = sorted({t["op"] for t in data}, key=list(OPS).index)
        sizes = sorted({t["size_bytes"] for t in data})
        fig, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 4), sharey=True)
        for ax, size in zip(axes if len(sizes) > 1 else [axes], sizes, strict=True):
            cell = {t["op"]: t for t in data if t["size_bytes"] == size}
            xs = range(len(ops))
            ax.bar([x - 0.2 for x in xs], [cell[o]["ours"] if o in cell else 0 for o in ops],
                   0.4, label="yuebing")
            ax.bar([x + 0.2 for x in xs], [(cell[o]["original"] or 0) if o in cell else 0
                                           for o in ops], 0.4, label="original")
            ax.set_xticks(list(xs), ops, rotation=60, ha="right", fontsize=8)
            ax.set_title(f"{size // 1024} KiB")
        (axes[0] if len(sizes) > 1 else axes).set_ylabel("GB/s")
        fig.suptitle(f"store data path: {path} (original: {VARIANT[path]})")
        fig.legend(*(axes[0] if len(sizes) > 1 else axes).get_legend_handles_labels())
        fig.tight_layout()
        p = img / f"store_{path}.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        made.append(p)
    meta = [t for t in table if t["metric"] == "ops/s"]
    if meta:
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [f"{t['path']}\n{t['op']}" for t in meta]
        xs = range(len(meta))
        ax.bar([x - 0.2 for x in xs], [t["ours"] for t in meta], 0.4, label="yuebing")
        ax.bar([x + 0.2 for x in xs], [t["original"] or 0 for t in meta], 0.4, label="original")
        ax.set_xticks(list(xs), labels, rotation=70, ha="right", fontsize=7)
        ax.set_ylabel("keys / s")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        p = img / "store_metadata_ops.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        made.append(p)
    return made


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--img", default="docs/img")
    ns = ap.parse_args()
    table = merged(Path(ns.out))
    print(markdown(table))
    for p in plot(table, Path(ns.img)):
        print(f"\n![{p.stem}](img/{p.name})")


if __name__ == "__main__":
    main()
