"""Where same-host 16 MiB store time goes: the transfer engine's shm WRITE alone vs store
``put_from`` / ``get_into`` (checksums off) vs a plain ``np.copyto``, interleaved, three rounds.

    .venv/bin/python benchmarks/store_shm_breakdown.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from yuebing.store.benchprocs import start_master, start_node
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig
from yuebing.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest

SIZE = 16 << 20
CALLS = 16


def rate(fn: Callable[[int], object]) -> float:
    t = time.perf_counter()
    for i in range(CALLS):
        fn(i)
    return CALLS * SIZE / (time.perf_counter() - t) / 1e9


def main() -> None:
    mst = start_master()
    node = start_node(mst.info["address"], "1GiB")
    try:
        seg = node.info["dram"]
        engine = TransferEngine(TransferConfig(metadata="p2p"))
        c = StoreClient(ClientConfig(master=mst.info["address"], checksum=False), engine=engine)
        src = np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8)
        dst = np.ones(SIZE, dtype=np.uint8)
        for i in range(60):  # warm the whole segment (page tables of both processes)
            c.put_from(f"w{i}", src)
        c.remove_all(force=True)
        for r in range(3):
            a = rate(lambda i: engine.transfer(
                [TransferRequest(OpCode.WRITE, src, seg, (i % 32) * SIZE, SIZE)]))
            b = rate(lambda i, r=r: c.put_from(f"k{r}/{i}", src))
            g = rate(lambda i, r=r: c.get_into(f"k{r}/{i}", dst))
            mc = rate(lambda i: np.copyto(dst, src))
            print(f"engine shm write {a:.2f}  store put_from {b:.2f}  store get_into {g:.2f}  "
                  f"np.copyto {mc:.2f} GB/s", flush=True)
            c.remove_all(force=True)
        c.close()
    finally:
        node.stop()
        mst.stop()


if __name__ == "__main__":
    main()
