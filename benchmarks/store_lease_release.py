"""What releasing read leases costs a get: CPU of the client and of the master per get, and the
get's wall time, on a master + node started from the ``yuebing`` on ``PYTHONPATH``.

Run it alternately against two trees to compare (wall times on a loaded VM are noisy; CPU per
get is the steadier figure):

    for i in 1 2 3; do for t in /tmp/before /tmp/after; do
      PYTHONPATH=$t/src python benchmarks/store_lease_release.py --label $t; done; done

Each run: ``--warm`` gets, then ``--gets`` gets of ``--size``-byte values (put once, read in a
cycle), timing each get; the master's CPU is read from /proc before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "store"))

from store_procs import master, node  # noqa: E402

from yuebing.store.client.client import StoreClient  # noqa: E402
from yuebing.store.config import ClientConfig  # noqa: E402


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(ns: argparse.Namespace) -> dict[str, float | str]:
    mst = master("--lease-ttl-s", "5", "--spin-us", str(ns.master_spin_us))
    nd = node(mst.info["address"], "64MiB", "--name", "lease-bench")
    try:
        with StoreClient(ClientConfig(master=mst.info["address"], checksum=False)) as c:
            keys = [f"v/{i}" for i in range(64)]
            for k in keys:
                c.put(k, os.urandom(ns.size))
            for i in range(ns.warm):
                c.get(keys[i % len(keys)])
            walls = []
            m0, c0 = cpu_s(mst.proc.pid), time.process_time()
            for i in range(ns.gets):
                t = time.perf_counter()
                c.get(keys[i % len(keys)])
                walls.append(time.perf_counter() - t)
            m1, c1 = cpu_s(mst.proc.pid), time.process_time()
    finally:
        nd.stop()
        mst.stop()
    return {"label": ns.label, "size": ns.size, "gets": ns.gets, "spin_us": ns.master_spin_us,
            "get_p50_us": round(statistics.median(walls) * 1e6, 1),
            "client_cpu_us_per_get": round((c1 - c0) / ns.gets * 1e6, 1),
            "master_cpu_us_per_get": round((m1 - m0) / ns.gets * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="")
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--gets", type=int, default=20000)
    p.add_argument("--warm", type=int, default=2000)
    p.add_argument("--master-spin-us", type=int, default=500,
                   help="the master's --spin-us (0: its CPU is only the work, no polling)")
    print(json.dumps(run(p.parse_args())), flush=True)


if __name__ == "__main__":
    main()
