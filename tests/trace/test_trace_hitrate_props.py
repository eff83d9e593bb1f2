"""Property tests: the OrderedDict replay equals a literal list-based reading of the spec, and
hit tokens never decrease with capacity."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from yuebing.trace.hitrate import simulate_global
from yuebing.trace.model import Request, Trace


def reference_hit_tokens(trace: Trace, capacity_blocks: int) -> int:
    """The semantics written out naively with a Python list (LRU first)."""
    order: list[int] = []
    hit = 0
    for r in sorted(trace.requests, key=lambda x: x.timestamp):
        m = 0
        while m < len(r.hash_ids) and r.hash_ids[m] in order:
            m += 1
        hit += min(m * 512, r.input_length)
        for h in reversed(r.hash_ids[:m]):
            order.remove(h)
            order.append(h)
        for h in reversed(r.hash_ids):
            if h in order:
                order.remove(h)
            order.append(h)
            if len(order) > capacity_blocks:
                order.pop(0)
    return hit


@st.composite
def prefix_traces(draw: st.DrawFn) -> Trace:
    """Requests whose ids extend earlier requests' prefixes (chained like real traces)."""
    paths: list[tuple[int, ...]] = [()]
    next_id = 0
    reqs = []
    for _ in range(draw(st.integers(1, 12))):
        base = paths[draw(st.integers(0, len(paths) - 1))]
        keep = draw(st.integers(0, len(base)))
        path = base[:keep]
        for _ in range(draw(st.integers(0 if keep else 1, 3))):
            path += (next_id,)
            next_id += 1
        paths.append(path)
        tail = draw(st.integers(0, 511))
        length = max(1, 512 * len(path) - tail)
        reqs.append(Request(draw(st.integers(0, 5)), length, 1, path))
    return Trace(tuple(reqs))


@settings(max_examples=150, deadline=None)
@given(prefix_traces(), st.integers(0, 10))
def test_matches_reference(trace: Trace, blocks: int) -> None:
    assert simulate_global(trace, blocks * 512).hit_tokens == reference_hit_tokens(trace, blocks)


@settings(max_examples=150, deadline=None)
@given(prefix_traces())
def test_hits_never_decrease_with_capacity(trace: Trace) -> None:
    hits = [simulate_global(trace, b * 512).hit_tokens for b in range(12)]
    assert hits == sorted(hits)
    assert hits[-1] <= simulate_global(trace, math.inf).hit_tokens
