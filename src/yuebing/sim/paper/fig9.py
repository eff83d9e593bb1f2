"""FAST'25 Mooncake Figure 9: prefix-cache hit rate vs capacity, global pool vs local caches.
Used by ``yuebing sim paper --figure 9``.

`compute` replays the conversation trace through `yuebing.trace.hitrate` at a sweep of
capacities: one global LRU pool of C tokens, and N local LRU caches of C/N tokens each with
requests spread round-robin (a cluster without a global pool); the full run adds 16 local
caches under longest-prefix routing. `plot` draws the curves. The paper's data points could not
be retrieved, so `PAPER["values"]` is ``None`` (see `PAPER`'s notes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PAPER: dict[str, Any] = {
    "figure": "FAST'25 Mooncake, Figure 9 (global vs local KVCache hit rate vs capacity)",
    "available": False,
    "values": None,
    "why": ("the figure's data points could not be retrieved (paper PDF not readable as text in "
            "the searchable index; no text rendering of the figure found); no numbers invented"),
    "related": {
        "arxiv_v3_table1_lru": {
            "source": "arXiv:2407.00079v3 §4.2, Table 1 text (different, earlier trace)",
            "capacity_blocks": [1000, 50000],
            "hit_ratio": [0.30, 0.50],
            "note": "single global LRU pool; 'further capacity increases show minimal "
                    "improvement'. Not comparable to the conversation trace.",
        },
    },
}
"""What the paper gives. Searched: the FAST'25 PDF, the arXiv versions, the Mooncake repository
and its issues; the PDF in kvcache-ai/Mooncake/FAST25-release is binary in the searchable index.
Mooncake issue #452 (a maintainer's reply) confirms only the design: §5.3 compares local and
global caches built on the same implementation, the local cache not transferring KVCache."""

BLOCK = 512
FULL_CAPACITIES = [2**k for k in range(17, 28)]
"""128Ki … 128Mi tokens; 128Mi tokens hold every distinct block of the conversation trace."""
FAST_CAPACITIES = [2**18, 2**21, 2**24, 2**27]
LOCAL_SIZES_FULL = (8, 16)
LOCAL_SIZES_FAST = (16,)


def _curve(trace: Any, capacities: list[int], caches: int, routing: str) -> list[float]:
    from yuebing.trace.hitrate import simulate_global, simulate_local

    if caches == 1:
        return [simulate_global(trace, c).hit_rate for c in capacities]
    return [simulate_local(trace, c, caches, routing).hit_rate for c in capacities]


def compute(trace_path: Path, fast: bool = False) -> dict[str, Any]:
    """Hit-rate curves on ``trace_path``; JSON-able, keyed as in the paper (global, local_N).

    ``fast`` uses 4 capacities and only 16 local caches (for tests and quick reports).

    The full run's 16 local caches under longest-prefix ("cache_aware") routing all get every
    request on this trace, since every request shares block 0 (see the result's ``notes``)."""
    from yuebing.trace.hitrate import simulate_global, simulate_local
    from yuebing.trace.io import load_trace

    trace = load_trace(trace_path)
    capacities = FAST_CAPACITIES if fast else FULL_CAPACITIES
    locals_ = LOCAL_SIZES_FAST if fast else LOCAL_SIZES_FULL
    result: dict[str, Any] = {
        "figure": 9,
        "trace": str(trace_path),
        "requests": len(trace),
        "block_size": trace.block_size,
        "capacity_tokens": list(capacities),
        "capacity_semantics": ("total tokens of all caches; local_N = N caches of floor(C/N) "
                               "tokens, requests routed round-robin"),
        "global": _curve(trace, capacities, 1, "global"),
        "unbounded": {"global": simulate_global(trace, math.inf).hit_rate},
    }
    for n in locals_:
        result[f"local_{n}"] = _curve(trace, capacities, n, "round_robin")
        result["unbounded"][f"local_{n}"] = simulate_local(
            trace, math.inf, n, "round_robin").hit_rate
    if not fast:
        result["local_16_cache_aware"] = _curve(trace, capacities, 16, "cache_aware")
        result["notes"] = ("local_16_cache_aware routes each request to the local cache with the "
                           "longest prefix (ties: least loaded, lowest index); all requests share "
                           "block 0, so it degenerates to one cache of C/16 tokens")
    result["paper"] = PAPER
    result["comparison"] = None if PAPER["values"] is None else "see paper"
    result["gap"] = ("cannot compare: paper values unavailable" if PAPER["values"] is None
                     else None)
    return result


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``fig9.png`` (hit rate vs capacity, log x) into ``out_dir``; returns its path."""
    from yuebing.sim.paper.common import pyplot, save_figure

    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    caps = result["capacity_tokens"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [k for k in result if k == "global" or k.startswith("local_")]
    for key in series:
        style = ":" if key.endswith("cache_aware") else "-"
        ax.plot(caps, result[key], style, marker="o", markersize=4, label=key)
    ub = result["unbounded"]["global"]
    ax.axhline(ub, color="grey", linestyle="--", linewidth=1,
               label=f"unbounded global ({ub:.3f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total cache capacity (tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, max(0.5, ub * 1.15))
    ax.set_title(f"Figure 9: prefix-cache hit rate ({result['requests']:,} requests)")
    if not result["paper"]["available"]:
        ax.text(0.01, 0.97, "paper's Figure 9 values unavailable — not plotted",
                transform=ax.transAxes, fontsize=8, va="top", color="dimgray")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.92))
    return [save_figure(fig, out_dir, "fig9.png")]
