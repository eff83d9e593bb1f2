"""Prefill attention paths side by side: per-layer time of every registered prefill path
(``sdpa``, ``grouped``, ``blas``, ``flash``) on the same chunks, interleaved, medians.

Shapes default to SmolLM2-135M (9 query heads, 3 kv heads, head_dim 64) in bf16. Each case is a
chunk of ``new`` tokens on top of ``cached`` tokens already in a paged pool (blocks of 16 in a
shuffled block table). Every path runs once per round in turn, so load from other processes hits
them alike; the median of the rounds is reported. Writes JSON and a PNG.

    .venv/bin/python benchmarks/prefill_attention.py --out reports/prefill_attention.json \
        --plot reports/prefill_attention.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from yuebing.engine import blas_attention, kernels, native  # noqa: F401  (register paths)
from yuebing.engine.attention import (
    PREFILL_IMPLS,
    PrefillSlice,
    causal_mask,
    head_index,
    prefill_supported,
)


def _case(new: int, cached: int, heads: int, kvh: int, hd: int, dtype: torch.dtype,
          bs: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrefillSlice]:
    ctx = new + cached
    nb = -(-ctx // bs)
    g = torch.Generator().manual_seed(ctx)
    k_cache = torch.randn(nb + 4, kvh, bs, hd, generator=g).to(dtype)
    v_cache = torch.randn(nb + 4, kvh, bs, hd, generator=g).to(dtype)
    table = torch.randperm(nb + 4, generator=g)[:nb]
    sl = PrefillSlice(0, new, ctx, head_index(table, kvh), causal_mask(new, ctx, torch.device("cpu")),
                      table)
    q = torch.randn(new, heads, hd, generator=g).to(dtype)
    return q, k_cache, v_cache, sl


def run(ns: argparse.Namespace) -> list[dict[str, object]]:
    torch.set_num_threads(ns.threads)
    dtype = getattr(torch, ns.dtype)
    if not native.load().ok:
        print(f"native kernels unavailable: {native.load().error}")
    paths = [p for p in PREFILL_IMPLS if prefill_supported(p, dtype, torch.device("cpu"))]
    rows = []
    for spec in ns.cases.split(","):
        cached, new = (int(x) for x in spec.split("+"))
        q, kc, vc, sl = _case(new, cached, ns.heads, ns.kv_heads, ns.head_dim, dtype)
        scale = ns.head_dim**-0.5
        times: dict[str, list[float]] = {p: [] for p in paths}
        for p in paths:  # warm-up
            PREFILL_IMPLS[p](q, kc, vc, sl, scale)
        for _ in range(ns.rounds):
            for p in paths:
                t0 = time.perf_counter()
                PREFILL_IMPLS[p](q, kc, vc, sl, scale)
                times[p].append(time.perf_counter() - t0)
        for p in paths:
            rows.append({"cached": cached, "new": new, "path": p,
                         "median_ms": statistics.median(times[p]) * 1e3})
    return rows


def report(rows: list[dict[str, object]], ns: argparse.Namespace) -> None:
    cases = sorted({(r["cached"], r["new"]) for r in rows}, key=lambda c: (c[1], c[0]))
    paths = list(dict.fromkeys(str(r["path"]) for r in rows))
    ms = {(r["cached"], r["new"], r["path"]): float(r["median_ms"]) for r in rows}  # type: ignore[arg-type]
    print("| cached + new | " + " | ".join(paths) + " |")
    print("|---|" + "---|" * len(paths))
    for c in cases:
        print(f"| {c[0]} + {c[1]} | " + " | ".join(f"{ms[(c[0], c[1], p)]:.2f} ms" for p in paths)
              + " |")
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(ns).items()},
                                      "rows": rows}, indent=1))
    if ns.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(paths)
        for i, p in enumerate(paths):
            ax.bar([x + i * width for x in range(len(cases))], [ms[(c[0], c[1], p)] for c in cases],
                   width, label=p)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))],
                      [f"{c[0]}+{c[1]}" for c in cases])
        ax.set_yscale("log")
        ax.set_xlabel("cached + new tokens")
        ax.set_ylabel("ms per layer (lower is better)")
        ax.set_title(f"prefill attention, {ns.dtype}, {ns.threads} threads")
        ax.legend()
        fig.tight_layout()
        ns.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(ns.plot, dpi=110)
        print(f"wrote {ns.plot}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="0+512,0+2048,256+256,1536+512",
                   help="comma-separated cached+new token counts")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    ns = p.parse_args()
    report(run(ns), ns)


if __name__ == "__main__":
    main()
