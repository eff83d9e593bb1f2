"""`Dispatcher._relay`'s request deadline around the hand-off, on in-memory event streams.

The relay arms one timer per request that ends the stream being read with a marker
(`InstanceClient.interrupt`). These tests pin the moment the stream being read changes from
the prefill's to the decode's: a deadline passing while the first token is with the client
must still end the decode's stream, as ``timeout``.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from yuebing.conductor.dispatch import Dispatcher, RequestFailed
from yuebing.conductor.stats import RequestStats
from yuebing.instance.client import InstanceClient
from yuebing.protocol.instance import EventKind, TaskEvent

RID = "cmpl-1"


class _Client:
    """The event side of `InstanceClient` (its own `timed_events` and `interrupt`) over
    queues the test fills."""

    timed_events = InstanceClient.timed_events
    interrupt = InstanceClient.interrupt

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Queue[tuple[TaskEvent, float]]] = {RID: asyncio.Queue()}

    def put(self, kind: EventKind, **kw: Any) -> None:
        self._events[RID].put_nowait((TaskEvent(request_id=RID, kind=kind, **kw),
                                      time.perf_counter()))


def _member(name: str) -> Any:
    return SimpleNamespace(id=name, alive=True, client=_Client())


def _dispatcher() -> Dispatcher:
    cluster = SimpleNamespace(prefill_done=lambda rid, instance_id: None)
    return Dispatcher(cluster, None, None, request_timeout_s=0.2)  # type: ignore[arg-type]


def test_deadline_while_the_first_token_is_with_the_client_ends_the_decode_stream() -> None:
    """The prefill's first token and its hand-off (FINISH) are both queued; the deadline
    passes while the consumer holds the first token; the decode never sends anything. The
    relay must end with ``timeout`` rather than wait on the decode without a deadline."""
    async def main() -> None:
        pre, dec = _member("p0"), _member("d0")
        pre.client.put(EventKind.FIRST_TOKEN, token_ids=[7], token_times=[time.time()])
        pre.client.put(EventKind.FINISH, finish_reason="handoff")
        gen = _dispatcher()._relay(RID, [pre], dec, False, RequestStats(RID, 0.0),
                                   time.monotonic() + 0.2, None)
        first = await anext(gen)
        assert first.token_ids == [7]
        await asyncio.sleep(0.4)  # the client is slow: the deadline passes meanwhile
        with pytest.raises(RequestFailed) as e:
            await asyncio.wait_for(anext(gen), 5.0)
        assert e.value.code == "timeout"
    asyncio.run(main())


def test_deadline_before_the_first_token_is_read_is_a_timeout_not_a_lost_prefill() -> None:
    """The deadline fires while the prefill's first token waits in its queue unread: the
    relay ends with ``timeout`` (the marker is not taken for a prefill failing before its
    hand-off)."""
    async def main() -> None:
        pre, dec = _member("p0"), _member("d0")
        pre.client.put(EventKind.FIRST_TOKEN, token_ids=[7], token_times=[time.time()])
        gen = _dispatcher()._relay(RID, [pre], dec, False, RequestStats(RID, 0.0),
                                   time.monotonic() - 1.0, None)
        await asyncio.sleep(0.05)  # not armed until the relay runs: first anext arms it
        with pytest.raises(RequestFailed) as e:
            async for _ in gen:
                await asyncio.sleep(0.05)  # the timer fires while the first token is out
        assert e.value.code == "timeout"
    asyncio.run(asyncio.wait_for(main(), 5.0))

