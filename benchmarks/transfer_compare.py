"""Compare `yuebing bench transfer` with Mooncake's transfer_engine_bench (TCP), run side by
side by benchmarks/transfer_vs_mooncake.sh. Usage: ``python transfer_compare.py OUT``.

Per round and cell the engines' own GB/s are read; each cell's value is the median over rounds.
For every (op, size, batch) the best configuration of each engine is compared (Mooncake: 1 or 2
initiator threads; yuebing: lanes), ratio = yuebing / Mooncake. Shared memory is compared with
single-thread memcpy measured in the same yuebing run. Writes OUT/compare.md, OUT/compare.json
and plots of the median yuebing rows to OUT/img/.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(out: Path) -> tuple[dict, dict]:
    mc: dict[tuple, list[float]] = defaultdict(list)
    for f in sorted(out.glob("mooncake_*/transfer_engine_bench.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "run" and row.get("GBps") is not None:
                mc[(row["op"], row["size"], row["batch"], row["threads"])].append(row["GBps"])
    ours: dict[tuple, list[dict]] = defaultdict(list)
    for f in sorted(out.glob("yuebing_*.json")):
        for row in json.loads(f.read_text()):
            key = (row["transport"], row["op"], row["size_bytes"], row["batch"], row["lanes"])
            ours[key].append(row)
    return mc, ours


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt_size(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 else f"{n >> 10}KiB"


def compare(mc: dict, ours: dict) -> tuple[list[dict], list[dict]]:
    tcp, shm = [], []
    cells = sorted({(op, size, batch) for (op, size, batch, _) in mc})
    for op, size, batch in cells:
        mc_cfg = {th: med(v) for (o, s, b, th), v in mc.items() if (o, s, b) == (op, size, batch)}
        our_cfg = {lanes: med([r["gbps"] for r in rows])
                   for (t, o, s, b, lanes), rows in ours.items()
                   if (t, o, s, b) == ("tcp", op, size, batch)}
        if not mc_cfg or not our_cfg:
            continue
        th, mc_best = max(mc_cfg.items(), key=lambda kv: kv[1])
        lanes, our_best = max(our_cfg.items(), key=lambda kv: kv[1])
        best_rows = [r for (t, o, s, b, ln), rows in ours.items()
                     if (t, o, s, b, ln) == ("tcp", op, size, batch, lanes) for r in rows]
        per_req = [r["per_request_us"] for r in best_rows]
        cpu_i = [r["cpu_us_initiator"] for r in best_rows if "cpu_us_initiator" in r]
        cpu_t = [r["cpu_us_target"] for r in best_rows if "cpu_us_target" in r]
        tcp.append({"op": op, "size_bytes": size, "batch": batch, "mooncake_gbps": round(mc_best, 3),
                    "mooncake_threads": th, "yuebing_gbps": round(our_best, 3),
                    "yuebing_lanes": lanes, "ratio": round(our_best / mc_best, 2),
                    "yuebing_per_request_us": round(med(per_req), 1),
                    "yuebing_cpu_us_initiator": round(med(cpu_i), 1) if cpu_i else None,
                    "yuebing_cpu_us_target": round(med(cpu_t), 1) if cpu_t else None,
                    "mooncake_by_threads": {k: round(v, 3) for k, v in sorted(mc_cfg.items())},
                    "yuebing_by_lanes": {k: round(v, 3) for k, v in sorted(our_cfg.items())}})
    for (t, op, size, batch, _), rows in sorted(ours.items()):
        if t == "shm":  # memcpy measured right after each shm cell, in the same run
            ref = [r["memcpy_gbps"] for r in rows if r.get("memcpy_gbps")]
            ratio = [r["vs_memcpy"] for r in rows if r.get("vs_memcpy")]
            shm.append({"op": op, "size_bytes": size, "batch": batch,
                        "shm_gbps": round(med([r["gbps"] for r in rows]), 3),
                        "memcpy_gbps": round(med(ref), 3) if ref else None,
                        "vs_memcpy": round(med(ratio), 2) if ratio else None})
    return tcp, shm


def overheads(tcp: list[dict]) -> list[str]:
    """Per-request overhead at 64 KiB × 128: wall time per request minus the time its bytes take
    at the engine's own best large-request bandwidth (same op)."""
    lines = []
    for op in ("write", "read"):
        small = [r for r in tcp if r["op"] == op and r["size_bytes"] == 65536 and r["batch"] == 128]
        large = [r for r in tcp if r["op"] == op and r["size_bytes"] >= 1 << 20]
        if not small or not large:
            continue
        s = small[0]
        for who, key in (("yuebing", "yuebing_gbps"), ("Mooncake", "mooncake_gbps")):
            bw = max(r[key] for r in large)
            per_req = 65536 / (s[key] * 1e3)
            cpu = (f"; CPU per request {s['yuebing_cpu_us_initiator']} µs initiator + "
                   f"{s['yuebing_cpu_us_target']} µs target"
                   if who == "yuebing" and s.get("yuebing_cpu_us_initiator") is not None else "")
            lines.append(f"- {who} {op}: {per_req:.1f} µs per 64 KiB request in batches of 128, "
                         f"{per_req - 65536 / (bw * 1e3):.1f} µs of it beyond moving the bytes "
                         f"at its best large-request bandwidth ({bw:.2f} GB/s){cpu}")
    return lines


def markdown(tcp: list[dict], shm: list[dict]) -> str:
    lines = ["| op | size | batch | Mooncake TE GB/s (threads) | yuebing GB/s (lanes) | ratio | "
             "yuebing µs/request | Mooncake by threads | yuebing by lanes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in tcp:
        lines.append(f"| {r['op']} | {fmt_size(r['size_bytes'])} | {r['batch']} | "
                     f"{r['mooncake_gbps']:.2f} ({r['mooncake_threads']}) | "
                     f"{r['yuebing_gbps']:.2f} ({r['yuebing_lanes']}) | **{r['ratio']:.2f}×** | "
                     f"{r['yuebing_per_request_us']} | {r['mooncake_by_threads']} | "
                     f"{r['yuebing_by_lanes']} |")
    lines += [""] + overheads(tcp)
    lines += ["", "| shm op | size | batch | shm GB/s | memcpy GB/s (1 thread) | shm / memcpy |",
              "|---|---|---|---|---|---|"]
    for r in shm:
        lines.append(f"| {r['op']} | {fmt_size(r['size_bytes'])} | {r['batch']} | "
                     f"{r['shm_gbps']:.2f} | {r['memcpy_gbps']} | {r['vs_memcpy']} |")
    return "\n".join(lines) + "\n"


def plot_medians(ours: dict, out: Path) -> None:
    from yuebing.transfer.bench import Row
    from yuebing.transfer.report import plot

    rows = []
    for (t, op, size, batch, lanes), rs in sorted(ours.items()):
        rows.append(Row(t, op, size, batch, lanes, med([r["gbps"] for r in rs]),
                        med([r["p50_us"] for r in rs]), med([r["p99_us"] for r in rs])))
    for p in plot(rows, out / "img", batch=16):
        print(f"# wrote {p}")


def plot_side_by_side(tcp: list[dict], out: Path) -> None:
    """GB/s vs request size (batch 16) of both engines over TCP, best configuration each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, style in (("write", "-"), ("read", "--")):
        rows = sorted((r for r in tcp if r["op"] == op and r["batch"] == 16),
                      key=lambda r: r["size_bytes"])
        xs = [r["size_bytes"] for r in rows]
        ax.plot(xs, [r["yuebing_gbps"] for r in rows], style, marker="o", label=f"yuebing {op}")
        ax.plot(xs, [r["mooncake_gbps"] for r in rows], style, marker="s",
                label=f"Mooncake TE {op}")
    sizes = sorted({r["size_bytes"] for r in tcp})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [fmt_size(s) for s in sizes])
    ax.set_xlabel("request size (batch 16)")
    ax.set_ylabel("GB/s (median of rounds, best config)")
    ax.set_title("TCP, two processes on loopback, side by side")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    (out / "img").mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "img" / "transfer_vs_mooncake.png", dpi=110)
    plt.close(fig)
    print(f"# wrote {out / 'img' / 'transfer_vs_mooncake.png'}")


def main() -> int:
    out = Path(sys.argv[1])
    mc, ours = load(out)
    if not mc or not ours:
        print(f"no results under {out} (mooncake cells: {len(mc)}, yuebing cells: {len(ours)})")
        return 1
    tcp, shm = compare(mc, ours)
    text = markdown(tcp, shm)
    print(text)
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps({"tcp": tcp, "shm": shm}, indent=1))
    plot_medians(ours, out)
    plot_side_by_side(tcp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
