"""``yuebing bench store --json`` row contract (a tiny real run: master + node processes)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from yuebing.store.bench import Bench

KEYS = {"path", "op", "size_bytes", "batch", "gbps", "ops_per_s", "p50_us", "p99_us"}


def test_bench_store_json_rows() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "yuebing.cli.main", "bench", "store", "--json", "--sizes", "64KiB",
         "--runs", "1", "--target-bytes", "1MiB", "--warm-bytes", "0", "--dram", "64MiB",
         "--meta-ops", "32", "--paths", "same_host,remote_tcp", "--pairs", "zc,zcbatch",
         "--batch", "4"], capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(out.stdout)
    assert all(set(r) == KEYS for r in rows)
    ops = [(r["path"], r["op"], r["batch"]) for r in rows]
    data = [("put_from", 1), ("get_into", 1), ("batch_put_from", 4), ("batch_get_into", 4)]
    meta = [("put_4k", 1), ("get_4k", 1), ("exists_hit", 1), ("exists_miss", 1),
            ("batch_exists", 4), ("remove", 1)]
    assert ops == [(p, o, b) for p in ("same_host", "remote_tcp") for o, b in data + meta]
    for r in rows:
        assert r["ops_per_s"] > 0 and r["p50_us"] > 0
        assert (r["gbps"] > 0) == (r["op"] not in {"exists_hit", "exists_miss", "batch_exists",
                                                   "remove"})
        assert r["size_bytes"] == {"put_4k": 4096, "get_4k": 4096}.get(
            r["op"], 0 if r["op"] in {"exists_hit", "exists_miss", "batch_exists", "remove"}
            else 65536)


def test_bench_store_raw_reference_rows() -> None:
    """``--raw``: single-value pairs on ``remote_tcp`` alternate with raw socket RPCs (rows
    ``raw_<op>`` walking a slot per call, ``raw_hot_<op>`` one slot) and carry the ratio to them
    with its spread (and to the one-slot RPC); batch pairs do not."""
    out = subprocess.run(
        [sys.executable, "-m", "yuebing.cli.main", "bench", "store", "--json", "--sizes", "64KiB",
         "--runs", "2", "--target-bytes", "1MiB", "--warm-bytes", "0", "--dram", "64MiB",
         "--paths", "remote_tcp", "--pairs", "single,batch", "--batch", "4", "--skip-meta",
         "--raw"], capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(out.stdout)
    assert [r["op"] for r in rows] == ["put", "get", "raw_put", "raw_get", "raw_hot_put",
                                       "raw_hot_get", "batch_put", "batch_get"]
    ratio = {"vs_raw", "vs_raw_min", "vs_raw_max", "vs_raw_hot"}
    for r in rows:
        assert r["gbps"] > 0
        if r["op"] in ("put", "get"):
            assert set(r) == KEYS | ratio
            assert 0 < r["vs_raw_min"] <= r["vs_raw"] <= r["vs_raw_max"]
        else:
            assert set(r) == KEYS


def test_a_starved_run_keeps_a_positive_ratio() -> None:
    """A run 5000 times slower than its raw reference (one process starved of CPU) shows its
    ratio to 3 significant digits, not rounded to 0; ordinary ratios keep 3 decimals."""
    bench = Bench(argparse.Namespace(sizes="64KiB", batch=1), None, "remote_tcp")
    bench.rows.append({})
    yb = [([], 10.0, 32), ([], 0.004, 32), ([], 0.002, 32)]  # (latencies, seconds, calls)
    raw = [([], 0.002, 32)] * 3
    bench._vs_raw(yb, raw, raw)
    assert bench.rows[-1] == {"vs_raw": 0.5, "vs_raw_min": 0.0002, "vs_raw_max": 1.0,
                              "vs_raw_hot": 0.5}
    bench.cell("put", 65536, 1, [([1e-3], 600.0, 1)])  # 64 KiB in 10 minutes
    assert bench.rows[-1]["gbps"] == 1.09e-7 and bench.rows[-1]["ops_per_s"] == 0.00167
