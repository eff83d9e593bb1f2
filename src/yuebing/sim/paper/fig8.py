"""Figure 8 (as we read it): popularity of KV blocks in the conversation trace.

Counts how many requests use each ``hash_ids`` block: the share of blocks used by exactly one
request and the most used blocks. The paper's text reports that most blocks are never reused
while a few are reused very often; we could not find the figure's exact numbers (see
docs/reproduction.md), so ``PAPER`` holds none.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from yuebing.sim.paper.common import FAST_LIMIT, pyplot, requests, save_figure

PAPER: dict[str, float] | None = None


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, object]:
    reqs = requests(trace_path, 1.0, FAST_LIMIT if fast else 0)
    counts = Counter(k for r in reqs for k in r.block_keys)
    uses = np.array(sorted(counts.values(), reverse=True))
    edges = [1, 2, 3, 5, 10, 100, 1000, 10**9]
    hist = {f"{lo}-{hi - 1}" if hi - lo > 1 else str(lo): int(((uses >= lo) & (uses < hi)).sum())
            for lo, hi in zip(edges, edges[1:], strict=False)}
    return {"blocks": int(uses.size), "share_used_once": float((uses == 1).mean()),
            "max_uses": int(uses[0]), "top10_uses": [int(u) for u in uses[:10]],
            "blocks_by_uses": hist}


def plot(result: dict[str, object], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    hist = result["blocks_by_uses"]
    assert isinstance(hist, dict)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(hist), list(hist.values()))
    ax.set_yscale("log")
    ax.set_xlabel("requests using the block")
    ax.set_ylabel("blocks")
    ax.set_title("Figure 8: KV block popularity (conversation trace)")
    return [save_figure(fig, out_dir, "fig8_block_popularity.png")]
