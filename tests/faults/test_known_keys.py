"""The KV connector remembers which store keys it saw stored, so a save skips them without
asking the store — but only for ``known_ttl_s``: the store may lose a key since (eviction, a
dead node, a restarted master), and a prompt saved again after that asks the store and puts
the block back. Found by tests/faults: after the store master's ``kill -9`` and restart, the
prefill never saved the blocks it had saved before, so the store stayed empty."""

from __future__ import annotations

import time

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.instance.connector import KVConnector, KVConnectorConfig

TINY = "dummy:preset=tiny,vocab=512,layers=2,hidden=64,heads=4,kv_heads=2,ffn=64,ctx=4096,tie=0"


def test_known_keys_expire_so_a_lost_block_is_saved_again() -> None:
    e = LLMEngine(EngineConfig(model=TINY, dtype="float32", threads=1, num_blocks=128))
    ids = [(i * 7) % 500 for i in range(512)]  # 2 store blocks of 256
    e.generate([ids], SamplingParams(max_tokens=1))
    conn = KVConnector(e, object(), KVConnectorConfig(staging_bytes=8 << 20,
                                                      known_ttl_s=0.3))
    conn._remember(conn.keys(ids))  # a save found both stored
    assert conn.snapshot(e, ids) is None  # known: nothing to copy, nothing asked
    time.sleep(0.4)  # the store may have lost them since
    snap = conn.snapshot(e, ids)
    assert snap is not None and snap.keys == conn.keys(ids)
    conn.staging.give(snap.lease)
