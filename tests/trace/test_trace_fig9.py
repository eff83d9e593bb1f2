"""Figure 9 (sim/paper/fig9.py): result shape, exactness vs the hit-rate core, plot output."""

from __future__ import annotations

import json
import math
from pathlib import Path

from yuebing.sim.paper import fig9
from yuebing.trace.hitrate import simulate_global, simulate_local
from yuebing.trace.io import load_trace


def test_fig9_fast_compute_and_plot(conversation_trace: Path, tmp_path: Path) -> None:
    r = fig9.compute(conversation_trace, fast=True)
    json.dumps(r, allow_nan=False)  # JSON-able, no inf/nan
    assert r["capacity_tokens"] == fig9.FAST_CAPACITIES
    assert r["requests"] == 12_031
    trace = load_trace(conversation_trace)
    c = fig9.FAST_CAPACITIES[2]
    assert r["global"][2] == simulate_global(trace, c).hit_rate
    assert r["local_16"][2] == simulate_local(trace, c, 16, "round_robin").hit_rate
    assert r["unbounded"]["global"] == simulate_global(trace, math.inf).hit_rate
    assert all(g >= loc for g, loc in zip(r["global"], r["local_16"], strict=True))
    assert r["global"] == sorted(r["global"])
    assert r["paper"] is fig9.PAPER and r["paper"]["values"] is None
    assert r["gap"] == "cannot compare: paper values unavailable"
    (png,) = fig9.plot(r, tmp_path / "out")
    assert png == tmp_path / "out" / "fig9.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
