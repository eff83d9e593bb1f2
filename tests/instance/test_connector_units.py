"""KVConnector without a store process: staging bounds, partial snapshots, keys."""

from __future__ import annotations

import torch

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.instance.connector import KVConnector, KVConnectorConfig, Staging

TINY = "dummy:preset=tiny,vocab=512,layers=2,hidden=64,heads=4,kv_heads=2,ffn=64,ctx=4096,tie=0"


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=TINY, dtype="float32", threads=1, num_blocks=512))


def test_snapshot_saves_the_leading_blocks_that_fit_in_staging():
    e = _engine()
    ids = [(i * 13) % 500 for i in range(1024)]  # 4 store blocks of 256
    e.generate([ids], SamplingParams(max_tokens=1))
    probe = KVConnector(e, None, KVConnectorConfig(staging_bytes=1 << 20))
    room = 2 * probe.object_bytes + 100  # two store blocks fit, not four
    conn = KVConnector(e, object(), KVConnectorConfig(staging_bytes=room))  # type: ignore[arg-type]
    snap = conn.snapshot(e, ids)
    assert snap is not None and snap.keys == conn.keys(ids)[:2]
    assert conn.stats.staging_full == 1
    data = snap.data.view(e.pool.dtype).view(32, *e.pool.block_shape)
    blocks = [e.allocator.lookup(k, ids[i * 16:(i + 1) * 16])
              for i, k in enumerate(e.block_keys(ids)[:32])]
    assert torch.equal(data, e.pool.export_blocks(blocks))
    assert conn.snapshot(e, ids) is None  # no room left until the save gives it back
    conn.staging.give(snap.lease)


def test_staging_is_first_fit_and_bounded():
    s = Staging(torch.empty(100, dtype=torch.uint8))
    a, b = s.take(40), s.take(40)
    assert a is not None and b is not None and s.take(30) is None
    s.give(a[0])
    c = s.take(30)
    assert c is not None and c[0] == a[0]  # reuses the freed front
    # free now: 30..40 and 80..100
    assert s.take(21) is None
    d, e = s.take(20), s.take(10)
    assert d is not None and d[0] - 1 == 80 and e is not None and e[0] - 1 == 30
    assert s.take(1) is None


def test_a_background_job_that_raises_fails_its_task_with_an_error_event():
    import asyncio
    from types import SimpleNamespace

    from yuebing.instance.base import Instance, Task
    from yuebing.protocol.instance import ErrorCode

    failed: list[tuple[str, ErrorCode, str]] = []
    stub = SimpleNamespace(_handlers=set(),
                           fail=lambda t, c, e: failed.append((t.request_id, c, e)))
    task = Task("r1", b"owner", [1, 2], SamplingParams())

    async def boom() -> None:
        raise KeyError("lost")

    async def fine() -> None:
        return None

    async def go() -> None:
        Instance.spawn(stub, task, boom())  # type: ignore[arg-type]
        Instance.spawn(stub, Task("r2", b"o", [1], SamplingParams()), fine())  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
    asyncio.run(go())
    assert failed == [("r1", ErrorCode.INTERNAL, "KeyError: 'lost'")]
    assert not stub._handlers
