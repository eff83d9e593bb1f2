"""Where same-host 16 MiB store time goes: the transfer engine's shm WRITE alone vs store
put_from/get_into (checksums off) vs a plain memcpy, interleaved, three rounds.

    .venv/bin/python benchmarks/store_shm_breakdown.py
"""
import time

import numpy as np

from yuebing.store.benchprocs import start_master, start_node
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig
from yuebing.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest

mst=start_master(); node=start_node(mst.info["address"], "1GiB")
try:
    seg=node.info["dram"]
    e=TransferEngine(TransferConfig(metadata="p2p"))
    c=StoreClient(ClientConfig(master=mst.info["address"], checksum=False), engine=e)
    size=16<<20
    src=np.random.default_rng(0).integers(0,255,size,dtype=np.uint8); dst=np.ones(size,dtype=np.uint8)
    for i in range(60): c.put_from(f"w{i}", src)   # warm the whole 1GiB
    c.remove_all(force=True)
    for rep in range(3):
        t=time.perf_counter()
        for i in range(16): e.transfer([TransferRequest(OpCode.WRITE, src, seg, (i%32)*size, size)])
        a=16*size/(time.perf_counter()-t)/1e9
        t=time.perf_counter()
        for i in range(16): c.put_from(f"k{rep}/{i}", src)
        b=16*size/(time.perf_counter()-t)/1e9
        t=time.perf_counter()
        for i in range(16): c.get_into(f"k{rep}/{i}", dst)
        g=16*size/(time.perf_counter()-t)/1e9
        t=time.perf_counter()
        for i in range(16): np.copyto(dst, src)
        mc=16*size/(time.perf_counter()-t)/1e9
        print(f"engine write {a:.2f}  store put_from {b:.2f}  get_into {g:.2f}  memcpy {mc:.2f} GB/s")
        c.remove_all(force=True)
finally:
    node.stop(); mst.stop()
