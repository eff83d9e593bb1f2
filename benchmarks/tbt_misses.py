"""Why a 1P1D run's requests miss the TBT SLO: its decode steps, attributed (issue 25).

Reads a `serve_vs_vllm.sh` result directory (``yuebing_1p1d.records.jsonl`` and the instances'
``--step-trace-dir`` files under ``logs/yuebing_1p1d``). Each answered request is matched to the
decode step that took it in (its first step there, over the prompt's KV), found by one clock
offset between the load generator and the steps; its token intervals are then the
ends of the next ``output_tokens - 2`` decode steps, and its TBT the paper's (mean of the longest
10 %, `yuebing.trace.latency.tbt_summary`), checked against the recorded one. For the requests
that missed, it prints the kinds of steps behind their longest intervals and how many would pass
if one cause were removed (counterfactuals on a least-squares step model per thread count).

    python benchmarks/tbt_misses.py /work/quiet/s18/h2h_sjf225 --rate 0.225 [--slo-tbt 0.1]
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from yuebing.trace.latency import tbt_summary

Step = dict[str, float]
Interval = tuple[float, int, bool]
"""(seconds, index of the decode step that ended it, whether it is the request's first)."""


def _joins(s: Step) -> bool:
    """Whether a request joined the decode in step ``s`` (a 1-token prefill chunk before the
    scheduler took such requests in as decodes; ``joined`` since)."""
    return bool(s["prefill_tokens"] or s.get("joined"))


def _joined_context(s: Step) -> float:
    return s["prefill_cached_tokens"] + s.get("joined_context", 0)


def _lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] \
        if path.exists() else []


def offset(records: list[dict], steps: list[Step]) -> float:
    """Wall clock minus the load generator's clock: the anchor (a join step whose prompt matches
    the first request's) under which most of the first 50 requests find their join step."""
    joins = [(s["t"], _joined_context(s)) for s in steps if _joins(s)]
    order = sorted(records, key=lambda r: r["start_s"] + r["ttft_s"])
    first = order[0]
    best = (-1, 0.0)
    for t, cached in joins:
        if cached != first["prompt_tokens"]:
            continue
        off = t - (first["start_s"] + first["ttft_s"])
        hits = sum(any(abs(jt - (r["start_s"] + r["ttft_s"] + off)) < 0.5
                       and c >= r["prompt_tokens"] for jt, c in joins) for r in order[:50])
        best = max(best, (hits, off))
    if best[0] < 0:
        raise SystemExit("no decode step takes in the first request: wrong step file?")
    return best[1]


def intervals(records: list[dict], steps: list[Step], off: float
              ) -> list[tuple[dict, list[Interval]]]:
    """Each answered request (≥ 3 tokens) with the token intervals its decode steps made."""
    joins = [i for i, s in enumerate(steps) if _joins(s)]
    join_t = [steps[i]["t"] for i in joins]
    used: set[int] = set()
    out = []
    for r in sorted(records, key=lambda r: r["start_s"] + r["ttft_s"]):
        if r.get("status") != "ok" or (r.get("output_tokens") or 0) < 3:
            continue
        first = r["start_s"] + r["ttft_s"] + off
        k = bisect.bisect_left(join_t, first - 0.3)
        while k < len(joins) and (joins[k] in used or
                                  _joined_context(steps[joins[k]]) < r["prompt_tokens"] - 1):
            k += 1
        if k == len(joins) or steps[joins[k]]["t"] > first + 10:
            continue  # not found near its first token (a cut run, or a step file cut short)
        i0 = joins[k]
        used.add(i0)
        idx = list(range(i0, min(len(steps), i0 + r["output_tokens"] - 1)))
        ends = [steps[i]["t"] + steps[i]["out_s"] for i in idx]
        iv = [(ends[0] - first, i0, True)] + [(ends[j] - ends[j - 1], idx[j], False)
                                            for j in range(1, len(idx))]
        out.append((r, iv))
    return out


def overlapped(steps: list[Step], prefill: list[Step]) -> list[bool]:
    """Per decode step: whether a prefill step covered more than half of it."""
    spans = sorted((p["t"], p["t"] + p["step_s"]) for p in prefill)
    starts = [a for a, _ in spans]
    out = []
    for s in steps:
        a, b = s["t"], s["t"] + s["step_s"]
        k, cover = max(0, bisect.bisect_left(starts, a) - 1), 0.0
        while k < len(spans) and spans[k][0] < b:
            cover += max(0.0, min(b, spans[k][1]) - max(a, spans[k][0]))
            k += 1
        out.append(cover > 0.5 * s["step_s"])
    return out


def fit(steps: list[Step], threads: int) -> np.ndarray:
    """Decode-only step seconds ≈ c0 + c1·batch + c2·(context tokens / 1000)."""
    rows = [s for s in steps if s["decodes"] and not _joins(s) and s["threads"] == threads]
    if len(rows) < 10:
        return np.zeros(3)
    x = np.array([[1, s["decodes"], s["context_tokens"] / 1000] for s in rows])
    return np.linalg.lstsq(x, np.array([s["step_s"] for s in rows]), rcond=None)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a serve_vs_vllm.sh result directory")
    ap.add_argument("--rate", type=float, help="the sweep rate to read (default: the last)")
    ap.add_argument("--slo-tbt", type=float, default=0.1)
    ns = ap.parse_args()
    records = _lines(ns.run / "yuebing_1p1d.records.jsonl")
    if not records:
        raise SystemExit(f"no records in {ns.run}")
    rate = ns.rate if ns.rate is not None else records[-1]["rate"]
    records = [r for r in records if r["rate"] == rate]
    logs = ns.run / "logs" / "yuebing_1p1d"
    steps = _lines(logs / "decode-0.steps.jsonl")
    prefill = _lines(logs / "prefill-0.steps.jsonl")
    off = offset(records, steps)
    reqs = intervals(records, steps, off)
    cover = overlapped(steps, prefill)
    model = {t: fit(steps, t) for t in (1, 2)}
    slo = ns.slo_tbt

    def pred(s: Step) -> float:
        c = model.get(int(s["threads"]), model[2])
        return float(c[0] + c[1] * max(s["decodes"], 1) + c[2] * s["context_tokens"] / 1000)

    missed = [(r, iv) for r, iv in reqs if r["tbt_s"] > slo]
    err = [tbt_summary([x for x, _, _ in iv])[0] - r["tbt_s"] for r, iv in reqs]
    print(f"{ns.run} at {rate} req/s: {len(records)} sent, {len(reqs)} matched to decode steps "
          f"(modelled − recorded TBT p50 {1e3 * float(np.median(err)):+.1f} ms); "
          f"TTFT misses {sum(r['ttft_s'] > 10 for r in records if r.get('status') == 'ok')}, "
          f"TBT misses {len(missed)}")
    if not prefill:
        print("  (no prefill step file: the run was cut before it was flushed; "
              "overlap unknown)")
    kinds: dict[str, list[float]] = {}
    for _, iv in missed:
        top = sorted(iv, reverse=True)[:math.ceil(len(iv) / 10)]
        for x, i, first in top:
            s = steps[i]
            kind = "own first step" if first else "other's join" if _joins(s) else "decode"
            kind += f", {int(s['threads'])} thread(s)" + (", beside a prefill" if cover[i] else "")
            kinds.setdefault(kind, []).append(x)
    print("  the missed requests' longest 10 % intervals, by the step that ended them:")
    for kind, xs in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {kind:45s} {len(xs):4d} intervals, mean {1e3 * float(np.mean(xs)):5.0f} ms")

    def passes(change: Callable[[float, Step, bool], float]) -> int:
        n = 0
        for r, iv in missed:
            new = [change(x, steps[i], first) for x, i, first in iv]
            delta = tbt_summary(new)[0] - tbt_summary([x for x, _, _ in iv])[0]
            n += r["tbt_s"] + delta <= slo
        return n

    c1, c2 = model[1], model[2]
    cases: dict[str, Callable[[float, Step, bool], float]] = {
        "decode always on 2 threads": lambda x, s, f: x if f or s["threads"] != 1 or not
        s["decodes"] else x * pred({**s, "threads": 2}) / max(pred(s), 1e-6),
        "attention (context) cost halved": lambda x, s, f: x if f else
        x - 0.5 * (c1 if s["threads"] == 1 else c2)[2] * s["context_tokens"] / 1000,
        "others' join steps cost a decode step": lambda x, s, f: x if f or not _joins(s)
        else x - s["step_s"] + pred(s),
        "own first interval 30 ms": lambda x, s, f: min(x, 0.03) if f else x,
        "no time between steps": lambda x, s, f: x if f else min(x, s["out_s"] + 0.001),
    }
    print(f"  of {len(missed)} TBT misses, would pass if:")
    for name, change in cases.items():
        print(f"    {name:40s} {passes(change)}")


if __name__ == "__main__":
    main()
