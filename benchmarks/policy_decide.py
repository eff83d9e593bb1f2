"""Benchmark: cost of one Conductor policy decision (`Policy.decide`) on 8P+8D snapshots.

The simulator calls ``decide`` once per request (12,031 for the conversation trace) for every
simulated system, inside a 20 s budget per system, so a decision must stay far below
20 s / 12,031 ≈ 1.7 ms. This script builds 512 varied, seeded snapshots of an 8-prefill +
8-decode cluster (queues, local prefixes, a global best prefix, decode batches, 64 pending
decodes), then times every prefill selector × admission policy over 12,031 decisions each.

    .venv/bin/python benchmarks/policy_decide.py [--decisions 12031] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from yuebing.conductor.policy import (
    ADMISSIONS,
    PREFILL_SELECTORS,
    BivariatePolynomial,
    ClusterView,
    DecodePredictor,
    DecodeState,
    PendingDecode,
    Policy,
    PolicyConfig,
    Predictors,
    PrefillPredictor,
    PrefillState,
    PrefixSource,
    RequestInfo,
    TransferPredictor,
)
from yuebing.core.ids import BlockHash, InstanceId

PREDICTORS = Predictors(
    PrefillPredictor(BivariatePolynomial(
        ((0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2)), (0.01, 8.6e-5, 0.0, 3.8e-9, 7.6e-9, 0.0))),
    DecodePredictor(BivariatePolynomial(((0, 0), (1, 0), (0, 1)), (0.017, 4e-4, 2.9e-8))),
    TransferPredictor(),
)


def snapshots(count: int, seed: int = 1) -> list[tuple[RequestInfo, ClusterView]]:
    rng = random.Random(seed)
    out = []
    for k in range(count):
        n_in = rng.randint(500, 60_000)
        nkeys = -(-n_in // 512)
        req = RequestInfo(f"r{k}", 0.0, n_in, tuple(BlockHash(b) for b in range(nkeys)),
                          rng.randint(1, 1000))
        prefills = tuple(PrefillState(InstanceId(f"p{i}"), rng.uniform(0, 20), rng.randint(0, 9),
                                      rng.randint(0, nkeys)) for i in range(8))
        decodes = tuple(DecodeState(InstanceId(f"d{j}"), b := rng.randint(0, 60),
                                    ctx := b * rng.randint(1000, 20_000), ctx, 1_330_000,
                                    rng.randint(0, 3), rng.randint(0, 30_000)) for j in range(8))
        best = max(p.local_prefix_blocks for p in prefills)
        pending = tuple(PendingDecode(rng.uniform(0, 30), rng.randint(1, 1000),
                                      InstanceId(f"d{rng.randint(0, 7)}"), rng.randint(500, 60_000))
                        for _ in range(64))
        view = ClusterView(0.0, prefills, decodes, PrefixSource(InstanceId("p0"), best),
                           100e9, 50e-6, pending)
        out.append((req, view))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=12_031)
    ap.add_argument("--repeat", type=int, default=3, help="best of N timings per combination")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args()
    cases = snapshots(512)
    rows = []
    for selector in PREFILL_SELECTORS:
        for admission in ADMISSIONS:
            pol = Policy(PolicyConfig(prefill_selector=selector, admission=admission,
                                      decode_durations_s=tuple(range(2, 40, 4))), PREDICTORS)
            dt = float("inf")
            for _ in range(ns.repeat):
                t0 = time.perf_counter()
                for k in range(ns.decisions):
                    req, view = cases[k % len(cases)]
                    pol.decide(req, view)
                dt = min(dt, time.perf_counter() - t0)
            rows.append({"prefill_selector": selector, "admission": admission,
                         "us_per_decision": dt / ns.decisions * 1e6, "trace_s": dt})
    if ns.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'selector':20s} {'admission':28s} {'µs/decision':>12s} {'12,031 decisions':>17s}")
    for r in rows:
        print(f"{r['prefill_selector']:20s} {r['admission']:28s} {r['us_per_decision']:12.1f} "
              f"{r['trace_s']:15.2f} s")


if __name__ == "__main__":
    main()
