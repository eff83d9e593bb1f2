"""`yuebing bench transfer` end to end (tiny sizes and durations): JSON rows and plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from yuebing.cli.main import main


def test_bench_transfer_json_rows_and_plots(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "yuebing.cli.main", "bench", "transfer", "--sizes", "64KiB,128KiB",
         "--lanes", "1,2", "--batch", "2", "--small-batch", "4", "--duration", "0.05", "--json",
         "--plot", str(tmp_path), "--raw", "2"], capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(out.stdout)
    keys = {"transport", "op", "size_bytes", "batch", "lanes", "gbps", "p50_us", "p99_us"}
    assert all(keys <= set(r) for r in rows)
    cells = {(r["transport"], r["op"], r["size_bytes"], r["batch"], r["lanes"]) for r in rows}
    expected = {("tcp", op, s, 2, n) for op in ("write", "read") for s in (65536, 131072)
                for n in (1, 2)}
    expected |= {("tcp", op, 65536, 4, n) for op in ("write", "read") for n in (1, 2)}
    expected |= {("shm", op, s, 2, 1) for op in ("write", "read") for s in (65536, 131072)}
    expected |= {("shm", op, 65536, 4, 1) for op in ("write", "read")}
    expected |= {("memcpy", "copy", s, 1, 1) for s in (65536, 131072)}
    assert cells == expected
    assert all(r["gbps"] > 0 and r["p99_us"] >= r["p50_us"] > 0 for r in rows)
    engine_rows = [r for r in rows if r["transport"] != "memcpy"]
    assert all(r["cpu_us_initiator"] > 0 and r["cpu_us_target"] >= 0 for r in engine_rows)
    assert all(r["vs_memcpy"] > 0 and r["memcpy_gbps"] > 0 for r in rows if r["transport"] == "shm")
    tcp = [r for r in rows if r["transport"] == "tcp"]
    assert all(r["raw_rounds"] == 2 and r["raw_gbps"] > 0 and r["raw_p50_us"] > 0
               and 0 < r["vs_raw_min"] <= r["vs_raw"] <= r["vs_raw_max"] for r in tcp)
    assert not any("vs_raw" in r for r in rows if r["transport"] != "tcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transfer_bw_vs_lanes.png",
                                                          "transfer_bw_vs_size.png"]


@pytest.mark.parametrize(("args", "message"), [
    (["--sizes", "1KiB"], "sizes must be >= 4KiB"),
    (["--transports", "rdma"], "transports must be tcp and/or shm"),
    (["--lanes", "0"], "lanes must be in 1..64 or -1"),
    (["--raw", "-1"], "raw_rounds must be in 0..1000"),
])
def test_bench_transfer_rejects_bad_flags(args: list[str], message: str, capsys) -> None:
    assert main(["bench", "transfer", *args]) == 2
    assert message in capsys.readouterr().err
