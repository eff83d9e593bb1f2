"""`PrefillGate`: FIFO admission by uncached prompt tokens, cancel and failure leave no trace."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from yuebing.conductor.cluster import LiveCluster, Member
from yuebing.conductor.gate import PrefillGate
from yuebing.instance.client import InstanceUnavailable
from yuebing.protocol.instance import Hello, LoadReport, Role


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_requests_pass_while_their_tokens_fit_and_one_always_passes() -> None:
    async def main() -> None:
        g = PrefillGate(1000)
        await g.acquire("a", 600)
        await g.acquire("b", 400)           # 1000: fits exactly
        c = asyncio.ensure_future(g.acquire("c", 5000))
        await asyncio.sleep(0)
        assert not c.done() and g.waiting == 1
        g.release("a")
        await asyncio.sleep(0)
        assert not c.done()                 # 400 + 5000 does not fit
        g.release("b")
        await asyncio.sleep(0)
        assert c.done() and g.inflight == {"c": 5000}  # alone it passes, however long
    _run(main())


def test_order_is_first_come_first_served() -> None:
    async def main() -> None:
        g = PrefillGate(100)
        await g.acquire("a", 50)
        order: list[str] = []

        async def go(rid: str, tokens: int) -> None:
            await g.acquire(rid, tokens)
            order.append(rid)
        waits = [asyncio.ensure_future(go("big", 90)), asyncio.ensure_future(go("small", 5))]
        await asyncio.sleep(0)
        assert order == []                  # "small" would fit beside "a" but does not overtake
        g.release("a")
        await asyncio.gather(*waits)
        assert order == ["big", "small"]
    _run(main())


def test_a_cancelled_wait_leaves_no_place_and_lets_the_next_go() -> None:
    async def main() -> None:
        g = PrefillGate(10)
        await g.acquire("a", 10)
        b = asyncio.ensure_future(g.acquire("b", 10))
        c = asyncio.ensure_future(g.acquire("c", 10))
        await asyncio.sleep(0)
        b.cancel()
        await asyncio.sleep(0)
        g.release("a")
        await asyncio.sleep(0)
        assert c.done() and g.inflight == {"c": 10} and g.waiting == 0
    _run(main())


def test_admitted_then_cancelled_gives_the_place_back() -> None:
    async def main() -> None:
        g = PrefillGate(10)
        await g.acquire("a", 10)
        b = asyncio.ensure_future(g.acquire("b", 10))
        await asyncio.sleep(0)
        g.release("a")                      # b is admitted ...
        b.cancel()                          # ... but cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await b
        assert g.inflight == {} and g.inflight_tokens == 0
    _run(main())


def test_fail_raises_in_every_waiter_and_drops_places() -> None:
    async def main() -> None:
        g = PrefillGate(10)
        await g.acquire("a", 10)
        b = asyncio.ensure_future(g.acquire("b", 1))
        await asyncio.sleep(0)
        g.fail(ConnectionError("instance p0 died"))
        with pytest.raises(ConnectionError, match="p0 died"):
            await b
        assert g.inflight == {} and g.waiting == 0
        g.release("a")                      # idempotent after fail
    _run(main())


def test_zero_means_no_limit_and_negative_is_refused() -> None:
    async def main() -> None:
        g = PrefillGate(0)
        for i in range(5):
            await g.acquire(str(i), 10**6)
        assert len(g.inflight) == 5
        with pytest.raises(ValueError, match="already holds"):
            await g.acquire("0", 1)
    _run(main())
    with pytest.raises(ValueError, match=">= 0"):
        PrefillGate(-1)


def test_waiters_go_in_the_queue_order_and_the_next_one_must_fit() -> None:
    from yuebing.conductor.policy import PREFILL_QUEUES, QueuedPrefill

    async def main() -> None:
        g = PrefillGate(100, PREFILL_QUEUES.get("sjf_aging")(0.1, 10.0), clock=lambda: 5.0)
        await g.acquire("a", 50)
        order: list[str] = []

        async def go(rid: str, tokens: int, prefill_s: float) -> None:
            await g.acquire(rid, tokens, QueuedPrefill(rid, 1.0, prefill_s, 11.0))
            order.append(rid)
        waits = [asyncio.ensure_future(go(rid, tokens, tokens / 10))
                 for rid, tokens in (("big", 90), ("mid", 60), ("small", 5))]
        await asyncio.sleep(0)
        # "small" is first in the order and fits beside "a": it goes at once, never idling
        # room behind "big", which does not fit; "mid" does not fit beside "a" either
        assert order == ["small"] and [w.request_id for w in g.queued()] == ["big", "mid"]
        g.release("a")
        await asyncio.sleep(0)
        assert order == ["small", "mid"]    # shortest first; "big" does not fit beside "mid"
        g.release("small")
        g.release("mid")
        await asyncio.gather(*waits)
        assert order == ["small", "mid", "big"] and g.queued() == ()
    _run(main())


def test_a_shared_gate_admits_one_owners_work_at_a_time() -> None:
    """A pipeline stage and its whole-model twin share one machine's gate: a twin's short
    prompt waits for the group's request and the next group request for the twin's."""
    async def main() -> None:
        g = PrefillGate(10_000)
        await g.acquire("short", 100, owner="twin")
        group = asyncio.ensure_future(g.acquire("long", 800, owner="stage"))
        await asyncio.sleep(0)
        assert not group.done()              # tokens fit, but the twin runs on the machine
        more = asyncio.ensure_future(g.acquire("short2", 100, owner="twin"))
        await asyncio.sleep(0)
        assert not more.done()               # behind the waiting group request (FIFO)
        g.release("short")
        await asyncio.sleep(0)
        assert group.done() and not more.done() and g.inflight == {"long": 800}
        g.fail(RuntimeError("stage died"), {"long"})   # only the stage's requests go
        await asyncio.sleep(0)
        assert more.done() and g.inflight == {"short2": 100}
    _run(main())


def _stage_member(c, name: str, **seat):  # type: ignore[no-untyped-def]
    h = Hello(seq=0, instance_id=name, role=Role.PREFILL, model="m", fingerprint="fp", host="h",
              control_address=f"tcp://{name}:1", kv_segment="s", block_size=16,
              store_block_tokens=256, num_blocks=64, max_model_len=4096, incarnation="i",
              num_layers=4, group="g", **seat)
    report = LoadReport(instance_id=name, incarnation="i", report_seq=1, time_s=0.0,
                        queued_prefill_tokens=0, queued_requests=0, running=0, waiting=0,
                        context_tokens=0, free_blocks=64, total_blocks=64, reserved_blocks=0,
                        prefill_tokens_per_s=1000.0, decode_step_s=0.05)
    m = Member(f"tcp://{name}:1", SimpleNamespace(fail_all=lambda reason: None), h,  # type: ignore[arg-type]
               report, gate=c._gate(h))
    c.members[m.id] = m
    return m


def test_a_dead_stage_fails_its_group_requests_at_every_stage_gate() -> None:
    """Stage s0 dies while a group request holds s0's gate and waits at s1's (behind s1's
    twin, whose seat is spelled differently): the request fails at once, not after its turn,
    both places are dropped, and the twin's own work is untouched."""
    async def main() -> None:
        c = LiveCluster(2.0, 1.0, 256, lambda n, k: 0.0, 1e7, 0.0)
        s0 = _stage_member(c, "s0", layers="0:2")
        s1 = _stage_member(c, "s1", layers="2:4")
        twin = _stage_member(c, "t1", twin_of="2: 4")
        assert twin.gate is s1.gate and c.twins([s0, s1]) == [twin]
        await twin.gate.acquire("short", 100, owner="t1")
        twin.prefilling["short"] = (0.1, 0.0)
        await s0.gate.acquire("long", 800, owner="s0")
        for s in (s0, s1):
            s.prefilling["long"] = (9.0, 0.0)
        waiting = asyncio.ensure_future(s1.gate.acquire("long", 800, owner="s1"))
        await asyncio.sleep(0)
        assert not waiting.done()
        c._mark_dead(s0, "s0 died")
        await asyncio.sleep(0)
        assert waiting.done() and isinstance(waiting.exception(), InstanceUnavailable)
        assert s0.gate.inflight == {} and s1.gate.inflight == {"short": 100}
    _run(main())
