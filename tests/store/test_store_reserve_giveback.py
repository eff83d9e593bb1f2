"""Reservations no write used are freed at once, never fenced (issue 15 item 10): the master
places none over a client's caps instead of dropping (and fencing) its oldest, and a client
gives back its stale, failed-segment and (at close) held reservations as unused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from store_procs import Proc, store_cluster

from yuebing.protocol import store as m
from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.client.reserve import HeldReservations
from yuebing.store.config import ClientConfig

KiB = 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Proc, Proc]]:
    with store_cluster("giveback") as (mst, nd):
        yield mst, nd


def _stats(addr: str) -> dict[str, float]:
    with StoreClient(ClientConfig(master=addr, reserve_ahead=False)) as c:
        out = c.stats()
        c.remove_all(force=True)
        return out


def test_close_frees_the_held_reservations_at_once(cluster) -> None:
    addr = cluster[0].info["address"]
    c = StoreClient(ClientConfig(master=addr))
    for i in range(3):
        c.put(f"close/{i}", bytes([i]) * (64 * KiB))
    before = c.stats()
    assert before["reservations"] == 1  # the next put of the shape is reserved
    c.close()
    after = _stats(addr)
    assert after["reservations"] == 0 and after["quarantined_bytes"] == 0
    assert after["dram_used"] == 3 * 64 * KiB  # the three values, nothing held back


def test_concurrent_puts_cycling_through_more_shapes_than_the_cap_fence_nothing(cluster) -> None:
    addr = cluster[0].info["address"]

    async def run() -> list[float]:
        c = AsyncStoreClient(ClientConfig(master=addr))
        seen = []
        try:
            for rnd in range(6):
                await asyncio.gather(*(c.put(f"cyc/{rnd}/{s}/{j}", b"x" * ((8 + s) * KiB))
                                       for s in range(8) for j in range(3)))
                seen.append((await c.stats())["quarantined_bytes"])
        finally:
            await c.close()
        return seen

    assert asyncio.run(run()) == [0.0] * 6
    after = _stats(addr)
    assert after["reservations"] == 0 and after["quarantined_bytes"] == 0


def test_stale_reservations_of_every_shape_are_given_back_once_and_never_held_again() -> None:
    h = HeldReservations()
    a, b = (8192, 1, "", ()), (4096, 1, "", ())
    h.keep(a, m.Reservation(key="ra", replicas=[], expires_in_s=10.0), sent=0.0)
    h.keep(b, m.Reservation(key="rb", replicas=[], expires_in_s=20.0), sent=0.0)
    assert h.drop_stale(4.0) == []  # both usable (half their grant left)
    assert h.drop_stale(6.0) == ["ra"]  # "a" is stale although no put of "a" came
    assert list(h.held) == [b]
    h.keep(a, m.Reservation(key="ra", replicas=[], expires_in_s=4.0), sent=6.0)  # a late copy
    assert list(h.held) == [b]
    assert h.drop_stale(7.0) == [] and h.drop_stale(30.0) == []  # "rb" expired: the master's
    assert h.held == {}
