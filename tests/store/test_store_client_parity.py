"""`StoreClient` and `AsyncStoreClient` are two drivers over one core: run against the same real
master and node (processes on 127.0.0.1), the same script of calls — puts (two-phase, through a
reservation, best effort, refused), gets, batch puts and gets, probes, removes, pins and bad
input — gives the same outcome per call (value or error type and code) and sends the master the
same requests, and both claim the reservations they write into."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from store_procs import store_cluster

from yuebing.core.errors import YuebingError
from yuebing.protocol import store as m
from yuebing.store.client import reserve as rv
from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.config import ClientConfig

Script = list[tuple[str, tuple, dict]]


def script(ns: str) -> Script:
    """The calls, with every key under ``ns`` (each client its own keys, same shapes)."""
    def k(*names: str) -> list[str]:
        return [ns + n for n in names]

    s: Script = [
        ("put", (ns + "a", b"a" * 4096), {}),
        ("put", (ns + "a", b"b" * 4096), {}),  # values are immutable
        ("get", (ns + "a",), {}),
        ("get_into", (ns + "a", bytearray(5000)), {}),
        ("get", (ns + "nope",), {}),
        ("get_into", (ns + "a", bytearray(10)), {}),  # too small a buffer
        ("put", ("", b"x"), {}),
        ("put", (ns + "empty", b""), {}),
        ("put", (m.RESERVED_PREFIX + "x", b"x"), {}),
        ("put", (ns + "two", b"t" * 1000), {"replicas": 2}),  # one node: no room for 2
        ("put", (ns + "two", b"t" * 1000), {"replicas": 2, "best_effort": True}),
    ]
    s += [("put", (f"{ns}r{i}", bytes([i]) * 2048), {}) for i in range(4)]  # reserved from r2
    s += [("batch_put", (k(*(f"b{j}{i}" for i in range(4))), [bytes([j]) * 512] * 4), {})
          for j in range(3)]  # the third batch through held reservations
    s += [
        ("batch_put", (k("c0", "a"), [b"c" * 300, b"d" * 300]), {"soft_pin_s": 5.0}),
        ("batch_put", (k("c1"), []), {}),
        ("batch_get", (k("c0", "nope", "a", "r3"),), {}),
        ("batch_get_into", (k("c0", "nope"), [bytearray(300), bytearray(300)]), {}),
        ("batch_get_into", (k("c0"), []), {}),
        ("exists", (ns + "c0",), {}),
        ("batch_exists", (k("c0", "nope"),), {}),
        ("prefix_match", (k("b00", "b01", "nope", "b02"),), {}),
        ("pin", (k("c0", "nope"),), {"hard": True}),
        ("remove", (ns + "c0",), {}),  # hard-pinned
        ("remove", (ns + "c0",), {"force": True}),
        ("remove", (ns + "c0",), {}),  # gone
        ("batch_remove", (k("b00", "nope"),), {}),
        ("remove_prefix", (ns + "b1",), {}),
        ("stats", (), {}),
    ]
    return s


def outcome(result: Any) -> Any:
    """A call's result or error, without what differs by client (its keys, counts of all)."""
    if isinstance(result, YuebingError):
        return type(result).__name__, getattr(result, "code", None)
    if isinstance(result, bytearray | bytes):
        return bytes(result)
    if isinstance(result, list):
        return [outcome(r) for r in result]
    if isinstance(result, m.Removed):
        return result.n, result.kept
    if isinstance(result, dict):  # stats: both clients' values are counted together
        return sorted(result)
    return result


def recording(c: StoreClient | AsyncStoreClient) -> list[list[str]]:
    """Record the type of each request ``c`` sends the master, a list per call of the script
    (the runner appends one before each call)."""
    sent: list[list[str]] = [[]]
    call = c.rpc.call
    if isinstance(c, AsyncStoreClient):
        async def acall(msg: m.Message) -> m.Message:
            sent[-1].append(type(msg).__name__)
            return await call(msg)  # type: ignore[no-any-return, misc]
        c.rpc.call = acall  # type: ignore[method-assign]
    else:
        def scall(msg: m.Message) -> m.Message:
            sent[-1].append(type(msg).__name__)
            return call(msg)  # type: ignore[return-value]
        c.rpc.call = scall  # type: ignore[method-assign]
    return sent


def run_sync(c: StoreClient, calls: Script) -> list[tuple[Any, list[str]]]:
    sent = recording(c)
    out: list[Any] = []
    for name, args, kw in calls:
        sent.append([])
        try:
            got = getattr(c, name)(*args, **kw)
        except YuebingError as e:
            got = e
        out.append(outcome(got))
    return list(zip(out, sent[1:], strict=True))


async def run_async(c: AsyncStoreClient, calls: Script) -> list[tuple[Any, list[str]]]:
    sent = recording(c)
    out: list[Any] = []
    for name, args, kw in calls:
        sent.append([])
        try:
            got = await getattr(c, name)(*args, **kw)
        except YuebingError as e:
            got = e
        out.append(outcome(got))
    return list(zip(out, sent[1:], strict=True))


def claimed_only(c: StoreClient | AsyncStoreClient, committed: Callable[[str], bool]) -> None:
    """Every reservation the client wrote into is claimed (busy): a late reply carrying one
    again is not held (it would overwrite the committed value)."""
    assert c._resv.busy, "no reservation was claimed"
    key = next(iter(c._resv.busy))
    shape = next(iter(c._resv.held))
    before = [h.key for h in c._resv.held[shape]]
    c._resv.keep(shape, m.Reservation(key=key, replicas=[], expires_in_s=30.0),
                 time.monotonic())
    assert [h.key for h in c._resv.held[shape]] == before
    assert committed(key) is False  # renamed to the value's key at its commit


@pytest.mark.slow
def test_sync_and_async_clients_give_the_same_outcomes() -> None:
    with store_cluster("parity", dram="32MiB") as (mst, _):
        cfg = ClientConfig(master=mst.info["address"],  # the segment path and reservations
                           inline_max_bytes=0)          # (test_store_inline_client: held values)
        with StoreClient(cfg) as sc:
            sync = run_sync(sc, script("s/"))
            claimed_only(sc, sc.exists)

        async def main() -> list[tuple[Any, list[str]]]:
            async with AsyncStoreClient(cfg) as ac:
                got = await run_async(ac, script("a/"))
                in_loop = await ac.exists(next(iter(ac._resv.busy)))
                claimed_only(ac, lambda key: in_loop)
                return got

        aio = asyncio.run(main())
    calls = script("s/")
    for (name, args, _), s, a in zip(calls, sync, aio, strict=True):
        assert s == a, f"{name}{args}: sync {s} != async {a}"
    outcomes = dict(zip(range(len(calls)), sync, strict=True))
    assert outcomes[0] == (1, ["PutStart", "PutEnd"])
    assert outcomes[1][0] == ("StoreRpcError", m.Code.EXISTS)
    assert outcomes[4][0] == ("NotFoundError", None)
    assert outcomes[9][0] == ("StoreRpcError", m.Code.NO_SPACE) and outcomes[10][0] == 1
    assert outcomes[13][1] == outcomes[14][1] == ["PutCommit"]  # r2, r3: one RPC each
    assert outcomes[17][1] == ["BatchPutCommit"]
    assert rv.MAX_PER_SHAPE >= 4
