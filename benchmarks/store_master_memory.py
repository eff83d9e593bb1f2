"""Master metadata memory per object: commit N objects into a `MasterCore` (metadata only; the
segments are never backed by memory) and report resident-set growth per object.

    .venv/bin/python benchmarks/store_master_memory.py --objects 10000000 --out docs/img/store_master_memory.json

Keys look like block keys (16 hex chars + a 4-char prefix), values 64 KiB, one replica each,
spread over 64 segments (64 nodes x 16 TiB: metadata only).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

from rich.progress import Progress

from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount
from yuebing.store.config import MasterConfig
from yuebing.store.master.core import MasterCore


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--segments", type=int, default=64)
    ap.add_argument("--out", default="")
    ns = ap.parse_args()
    core = MasterCore(MasterConfig(high_watermark=1.0, evict_ratio=0.5))
    for i in range(ns.segments):
        core.handle(Mount(client=f"n{i}", segment=f"127.0.0.1:{9000 + i}/n{i}.dram",
                            size=16 << 40))
    gc.collect()
    base = rss()
    t0 = time.perf_counter()
    checkpoints = []
    with Progress() as prog:
        task = prog.add_task("commit objects", total=ns.objects)
        for i in range(ns.objects):
            key = f"blk/{i * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF:016x}"
            core.put_start(m.PutStart(client="c", item=m.PutItem(key=key, size=65536,
                                                                  checksum=i)))
            core.put_end(m.PutEnd(client="c", key=key))
            if (i + 1) % 100_000 == 0:
                prog.update(task, completed=i + 1)
                core.events.clear()
            if (i + 1) in (ns.objects // 10, ns.objects):
                checkpoints.append({"objects": i + 1, "rss_bytes": rss() - base})
    secs = time.perf_counter() - t0
    per = checkpoints[-1]["rss_bytes"] / ns.objects
    res = {"objects": ns.objects, "bytes_per_object": round(per, 1),
           "rss_growth_bytes": checkpoints[-1]["rss_bytes"],
           "gib_for_10M": round(per * 10_000_000 / 2**30, 2),
           "put_commit_per_s": round(ns.objects / secs), "checkpoints": checkpoints}
    print(json.dumps(res))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
