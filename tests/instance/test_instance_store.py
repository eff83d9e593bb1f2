"""Instances on the KV pool (real store master + node, real instance processes, dummy model):
a prefix one instance computed is loaded from the store by instances that never saw it (only
the suffix is computed, output unchanged), KV of another fingerprint is never loaded, a lost
node is a miss, and a peer instance's cache serves a prefix too."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import pytest
from instance_procs import TINY, run_coupled, run_disagg

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.instance.client import InstanceClient
from yuebing.instance.kvkeys import store_block_keys, store_key
from yuebing.protocol.instance import PrefixPlan, Sampling
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
import store_procs  # noqa: E402

GREEDY = Sampling(max_tokens=10, temperature=0, ignore_eos=True)
rng = random.Random(11)
PREFIX = [rng.randrange(500) for _ in range(2048)]
PROMPT = PREFIX + [rng.randrange(500) for _ in range(150)]
STORE_PLAN = PrefixPlan(tokens=2048, source="store")


def _reference(dtype: str) -> list[int]:
    e = LLMEngine(EngineConfig(model=TINY, dtype=dtype, threads=1, max_batch_tokens=256))
    return e.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0,
                                               ignore_eos=True))[0].output_token_ids


@pytest.fixture(scope="module")
def store():
    with store_procs.store_cluster("inst", dram="256MiB") as (master, node):
        yield master, node


def _wait_saved(master_addr: str, fingerprint: str, blocks: int, timeout_s: float = 30) -> None:
    keys = [store_key(fingerprint, k) for k in store_block_keys(PROMPT, 256, fingerprint)]
    with StoreClient(ClientConfig(master=master_addr), heartbeat=False) as c:
        end = time.monotonic() + timeout_s
        while c.prefix_match(keys) < blocks:
            assert time.monotonic() < end, "the prefill's blocks never reached the store"
            time.sleep(0.1)


def test_store_prefix_is_loaded_by_instances_that_never_saw_it(procs, store, run):
    master_addr = store[0].info["address"]
    flags = ("--store-master", master_addr)
    first, fresh = procs("coupled", *flags), procs("coupled", *flags)
    prefill, decode_ = procs("prefill", *flags), procs("decode")
    other = procs("coupled", *flags, "--dtype", "bfloat16")

    async def go():
        a = InstanceClient(first.address)
        cold = await run_coupled(a, "cold", PROMPT, GREEDY)
        _wait_saved(master_addr, first.hello["fingerprint"], 8)
        b, p, d, o = (InstanceClient(x.address) for x in (fresh, prefill, decode_, other))
        hit = await run_coupled(b, "hit", PROMPT, GREEDY, STORE_PLAN)
        disagg = await run_disagg(p, d, "pd", PROMPT, GREEDY, STORE_PLAN)
        mismatch = await run_coupled(o, "bf16", PROMPT, GREEDY, STORE_PLAN)
        for c in (a, b, p, d, o):
            await c.close()
        return cold, hit, disagg, mismatch
    cold, hit, disagg, mismatch = run(go())
    assert cold.cached_tokens == 0 and cold.tokens == _reference("float32")
    assert hit.cached_tokens == 2048 and hit.tokens == cold.tokens
    assert disagg.cached_tokens == 2048 and disagg.tokens == cold.tokens
    # another dtype is another fingerprint: nothing loads, its own output is right
    assert other.hello["fingerprint"] != first.hello["fingerprint"]
    assert mismatch.cached_tokens == 0 and mismatch.tokens == _reference("bfloat16")


def test_a_node_lost_between_save_and_load_is_a_miss(procs, run):
    master = store_procs.master()
    node = store_procs.node(master.info["address"], "64MiB")
    try:
        flags = ("--store-master", master.info["address"])
        saver, loader = procs("coupled", *flags), procs("coupled", *flags)

        async def go():
            s = InstanceClient(saver.address)
            cold = await run_coupled(s, "save", PROMPT, GREEDY)
            _wait_saved(master.info["address"], saver.hello["fingerprint"], 8)
            node.kill()
            ld = InstanceClient(loader.address)
            after = await asyncio.wait_for(run_coupled(ld, "load", PROMPT, GREEDY, STORE_PLAN),
                                           120)
            await s.close()
            await ld.close()
            return cold, after
        cold, after = run(go())
        assert after.error == "" and after.cached_tokens == 0
        assert after.tokens == cold.tokens
    finally:
        node.kill()
        master.stop()


def test_prefix_from_a_peer_instance(procs, run):
    holder, fetcher = procs("coupled"), procs("coupled")

    async def go():
        h, f = InstanceClient(holder.address), InstanceClient(fetcher.address)
        cold = await run_coupled(h, "warm", PROMPT, GREEDY)
        plan = PrefixPlan(tokens=2048, source="peer", peer=holder.hello["instance_id"],
                          peer_address=holder.address)
        hit = await run_coupled(f, "peer", PROMPT, GREEDY, plan)
        # a peer that holds nothing is a miss, not an error
        miss = await run_coupled(h, "miss", PROMPT, GREEDY, PrefixPlan(
            tokens=2048, source="peer", peer_address=fetcher.address))
        await h.close()
        await f.close()
        return cold, hit, miss
    cold, hit, miss = run(go())
    assert hit.cached_tokens == 2048 and hit.tokens == cold.tokens
    assert miss.error == "" and miss.tokens == cold.tokens
