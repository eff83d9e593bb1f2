"""An instance whose store master accepts connections and never answers (stopped, or behind a
partition that stalls an established connection): a prefix load does not wait for a save."""

from __future__ import annotations

import asyncio
import random
import time

from instance_procs import run_coupled

from silent_master import silent_master
from yuebing.instance.client import InstanceClient
from yuebing.protocol.instance import EventKind, PrefixPlan, Sampling

GREEDY = Sampling(max_tokens=4, temperature=0, ignore_eos=True)
LOAD_TIMEOUT_S = 1.0


def test_a_load_does_not_queue_behind_a_save_stuck_on_a_master_that_never_answers(procs, run):
    """Regression: the connector's loads and saves shared one I/O thread. A save meeting a
    master that does not answer holds its call for the store client's failover budget (15 s);
    a load planned from the store meanwhile waited for it — its own `load_timeout_s` counted
    only once it ran — so the TTFT grew by up to 15 s exactly while the store was in trouble.
    Now saves run on a thread (and store client) of their own: the load is a miss within
    `--store-load-timeout-s` and the prefix is computed. Then a SIGTERM stops the instance
    within the connector's close grace (1 s) and a moment, not when the save's call ends."""
    rng = random.Random(5)
    cold_ids = [rng.randrange(500) for _ in range(600)]  # 2 full store blocks to save
    warm_ids = [rng.randrange(500) for _ in range(600)]
    with silent_master() as master:
        inst = procs("coupled", "--store-master", master.address,
                     "--store-load-timeout-s", str(LOAD_TIMEOUT_S))

        async def go():
            c = InstanceClient(inst.address)
            try:
                cold = await run_coupled(c, "cold", cold_ids, GREEDY)  # its save gets stuck
                end = time.monotonic() + 5
                while master.received == 0:  # the save's first master call is out, unanswered
                    assert time.monotonic() < end
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                warm = await run_coupled(c, "warm", warm_ids, GREEDY,
                                         PrefixPlan(tokens=512, source="store"))
                return cold, warm, time.monotonic() - t0
            finally:
                await c.close()
        try:
            cold, warm, took = run(go())
            t0 = time.monotonic()
            inst.stop()  # SIGTERM: its save, still stuck, gets the connector's close grace
            stopped = time.monotonic() - t0
        finally:
            inst.kill()
    assert not cold.error and cold.finish == "length" and len(cold.tokens) == 4
    assert not warm.error and warm.finish == "length" and warm.cached_tokens == 0  # a miss
    finish = next(ev for ev in warm.events if ev.kind == EventKind.FINISH)
    assert finish.breakdown is not None
    load_s = finish.breakdown.prefix_load_s
    assert 0.8 * LOAD_TIMEOUT_S <= load_s < LOAD_TIMEOUT_S + 1.5, load_s  # was ~14.5 s
    assert took < LOAD_TIMEOUT_S + 5.0, took
    assert inst.proc.returncode == 0 and stopped < 5.0, stopped  # a clean exit; was 14 s
