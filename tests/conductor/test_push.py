"""The relay's fast path (`yuebing.conductor.push`): the instance client offers a request's
events to its sink only while nothing of that request is queued; the `Pusher` writes a chunk
within the call unless the send suspends (flow control), and then finishes it in a task that
the response's own next write waits for, so order holds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from yuebing.conductor.delta import Delta
from yuebing.conductor.push import Pusher, token_sink
from yuebing.conductor.stats import RequestStats
from yuebing.instance.client import InstanceClient
from yuebing.protocol.instance import Breakdown, EventKind, TaskEvent

RID = "r1"


def _ev(kind: EventKind, tok: int, **kw: Any) -> TaskEvent:
    return TaskEvent(request_id=RID, kind=kind, token_ids=[tok], text=f" t{tok}", **kw)


def _pusher(sent: list[bytes], send: Any = None) -> Pusher:
    async def plain(msg: dict[str, Any]) -> None:
        sent.append(msg["body"])
    p = Pusher(lambda d: d.text.encode(), lambda s: None)
    p.send = send or plain
    p.waiting = True
    return p


def test_the_client_offers_events_to_the_sink_only_while_none_is_queued() -> None:
    async def main() -> None:
        client = InstanceClient("tcp://127.0.0.1:1", token="")
        try:
            client._open_events(RID)
            taken: list[int] = []
            accept = [True]

            def sink(ev: TaskEvent, arrived: float) -> bool:
                if accept[0]:
                    taken.append(ev.token_ids[0])
                return accept[0]
            client.divert(RID, sink)
            client._event(_ev(EventKind.TOKENS, 1), 0.0)
            accept[0] = False
            client._event(_ev(EventKind.TOKENS, 2), 0.0)  # refused: queued
            accept[0] = True
            client._event(_ev(EventKind.TOKENS, 3), 0.0)  # 2 is queued: 3 must follow it
            events = client.timed_events(RID)
            assert taken == [1]
            assert [(await anext(events))[0].token_ids[0] for _ in range(2)] == [2, 3]
            client.divert(RID, None)
            client._event(_ev(EventKind.TOKENS, 4), 0.0)
            assert (await anext(events))[0].token_ids == [4] and taken == [1]
        finally:
            await client.close()
    asyncio.run(main())


def test_token_sink_takes_plain_tokens_only_and_records_them() -> None:
    async def main() -> None:
        sent: list[bytes] = []
        p = _pusher(sent)
        stats = RequestStats(RID, 0.0)
        sink = token_sink(p, stats)
        now = time.perf_counter()
        assert sink(_ev(EventKind.TOKENS, 5), now)
        assert not sink(_ev(EventKind.FINISH, 6, finish_reason="length"), now)
        assert not sink(_ev(EventKind.TOKENS, 7, breakdown=Breakdown()), now)
        assert not sink(_ev(EventKind.ERROR, 8), now)
        p.waiting = False  # the response's generator is writing itself
        assert not sink(_ev(EventKind.TOKENS, 9), now)
        assert sent == [b" t5"] and stats.completion_tokens == 1
    asyncio.run(main())


def test_a_send_held_by_flow_control_finishes_before_the_next_write() -> None:
    async def main() -> None:
        sent: list[bytes] = []
        writable = asyncio.Event()

        async def send(msg: dict[str, Any]) -> None:
            if msg["body"] == b" t2":
                await writable.wait()  # uvicorn's send waits for the transport to drain
            sent.append(msg["body"])
        p = _pusher(sent, send)
        p.push(Delta([1], " t1", None, time.perf_counter()))
        assert sent == [b" t1"] and p.ready()
        p.push(Delta([2], " t2", None, time.perf_counter()))
        assert sent == [b" t1"] and not p.ready()  # held: later events take the queue path
        await asyncio.sleep(0.01)  # nothing more may be sent meanwhile
        assert sent == [b" t1"]
        writable.set()
        await p.hold()  # the response's own next write waits for the held send
        assert sent == [b" t1", b" t2"] and not p.ready()
        p.waiting = True  # the response wrote and waits for its next delta again
        assert p.ready()
    asyncio.run(main())


def test_a_failed_send_stops_the_fast_path_and_is_raised_to_the_response() -> None:
    async def main() -> None:
        async def send(msg: dict[str, Any]) -> None:
            raise RuntimeError("response already complete")
        p = _pusher([], send)
        p.push(Delta([1], " t1", None, time.perf_counter()))
        assert not p.ready()
        with pytest.raises(RuntimeError, match="already complete"):
            await p.hold()
    asyncio.run(main())


def test_the_dispatch_phases_add_up_to_the_dispatch_time():
    from yuebing.conductor.stats import RequestStats

    s = RequestStats("r", arrival_s=10.0, body_s=10.001, parsed_s=10.003)
    assert s.dispatch_phases() == {}  # not dispatched yet
    s.started_s, s.decided_s, s.dispatched_s = 10.004, 10.006, 10.050
    s.gate_s, s.reserve_s = 0.030, 0.010
    p = s.dispatch_phases()
    assert list(p) == ["body", "parse", "start", "route", "send"]
    assert abs(sum(p.values()) - s.dispatch_s) < 1e-9
    assert abs(p["route"] - 0.002) < 1e-9 and abs(p["send"] - 0.004) < 1e-9


def test_the_conductors_garbage_collections_are_timed():
    import gc

    from yuebing.conductor.metrics import ConductorMetrics

    m = ConductorMetrics()
    m.watch_gc()
    try:
        gc.collect(2)
    finally:
        m.unwatch_gc()
    gc.collect(2)  # no longer watched
    count = m.registry.get_sample_value("yuebing:conductor_gc_seconds_count",
                                        {"generation": "2"})
    assert count == 1
