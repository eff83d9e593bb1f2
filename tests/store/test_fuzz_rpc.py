"""Fuzzing the store master's RPC port (hypothesis): random and type-correct-but-arbitrary
request messages in well-formed frames get a reply with their request id that is a valid
message — an error, if any, with a precise code, never INTERNAL (a handler that crashed) — or,
for one-way messages, nothing; garbled byte streams (absurd lengths, torn frames, junk) are
answered or cut. Throughout, the master keeps serving a well-behaved client and holds no more
than its ``--rpc-buffer-bytes`` of incomplete frames, none once the fuzzing connections are
gone."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import typing
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_factories import plain
from yuebing.protocol import decode, encode
from yuebing.protocol import store as m
from yuebing.protocol.codec import Message
from yuebing.protocol.store_cluster import Drain, Landed, Mount, Unmount
from yuebing.store.config import MasterConfig
from yuebing.store.master.service import MasterService
from yuebing.store.wire import FrameSocket, parse_address

REQUESTS = [m.PutStart, m.PutCommit, m.PutEnd, m.PutRevoke, m.BatchPutStart, m.BatchPutCommit,
            m.BatchPutEnd, m.BatchPutRevoke, m.GetReplicas, m.BatchGetReplicas, m.ReleaseLeases,
            m.Exists, m.BatchExists, m.PrefixMatch, m.Remove, m.BatchRemove, m.RemovePrefix,
            m.RemoveAll, m.Pin, Mount, Unmount, Drain, m.Heartbeat, m.GetStats, Landed,
            m.ConnName]
ONE_WAY = (m.ReleaseLeases, Landed, m.ConnName)
"""Requests the master answers with nothing (a lease release rides along with other calls; a
node's landing report is answered, if at all, to the client named in it; a connection's name)."""

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


def _field(tp: Any) -> st.SearchStrategy[Any]:
    """Values of type ``tp`` (arbitrary within it), or anything at all now and then."""
    try:
        typed = st.from_type(tp)
    except Exception:  # noqa: BLE001 - a type hypothesis cannot build: anything goes
        return values
    return typed | values if tp is not bool else typed


def _plain(v: Any) -> Any:
    return plain(v, 2**64 - 1)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    cls = draw(st.sampled_from(REQUESTS))
    hints = typing.get_type_hints(cls)
    body: dict[str, Any] = {"type": cls.__struct_config__.tag}
    for name in cls.__struct_fields__:
        if name == "v" or draw(st.integers(0, 9)) == 0:
            continue  # keep the version; now and then leave a field out
        body[name] = draw(_field(hints[name]))
    if draw(st.integers(0, 19)) == 0:
        body["v"] = draw(st.integers(-5, 2**40))
    return msgspec.msgpack.encode(_plain(body))


class _Errors(logging.Handler):
    """ERROR records of the store (an internal error the server survived is still a bug)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


ERRORS = _Errors()


@pytest.fixture(scope="module")
def master() -> Iterator[MasterService]:
    logging.getLogger("yuebing.store").addHandler(ERRORS)
    svc = MasterService(MasterConfig(
        rpc_address="tcp://127.0.0.1:0", max_request_bytes=64 << 10,
        rpc_buffer_bytes=256 << 10, frame_timeout_s=0.5, room_wait_s=0.0, client_ttl_s=60))
    t = threading.Thread(target=svc.serve, daemon=True)
    t.start()
    yield svc
    svc.stop()
    t.join(10)
    logging.getLogger("yuebing.store").removeHandler(ERRORS)


def _serving(svc: MasterService) -> None:
    """A well-behaved client still gets its answer."""
    s = FrameSocket(svc.address, 5.0)
    try:
        s.send(1, encode(m.Exists(key="still/serving")))
        got = s.recv(5.0)
        assert got is not None and isinstance(decode(got[1]), m.Bools)
    finally:
        s.close()
    assert svc.server.buffered <= svc.cfg.rpc_buffer_bytes
    assert not ERRORS.records, ERRORS.records


fuzz = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@fuzz
@given(payload=messages() | st.binary(max_size=64))
def test_random_requests_get_a_precise_reply(master: MasterService, payload: bytes) -> None:
    s = FrameSocket(master.address, 5.0)
    try:
        s.send(77, payload)
        got = s.recv(3.0)
    finally:
        s.close()
    if got is None:
        msg = msgspec.msgpack.decode(payload)
        assert isinstance(msg, dict) and msg.get("type") in {c.__struct_config__.tag
                                                               for c in ONE_WAY}, msg
    else:
        rid, raw = got
        reply = decode(raw)
        assert rid == 77 and isinstance(reply, Message)
        if isinstance(reply, m.Err):
            assert reply.code != m.Code.INTERNAL, reply.message
            assert reply.message
    _serving(master)


@fuzz
@given(chunks=st.lists(
    st.binary(max_size=40)
    | st.builds(lambda n, rid, body: struct.pack("<IQ", n, rid) + body,
                st.integers(0, 2**32 - 1) | st.integers(0, 70_000), st.integers(0, 2**64 - 1),
                st.binary(max_size=40)), min_size=1, max_size=5))
def test_garbled_streams_are_answered_or_cut(master: MasterService, chunks: list[bytes]) -> None:
    s = socket.create_connection(parse_address(master.address), timeout=2)
    try:
        for c in chunks:
            s.sendall(c)
    except OSError:
        pass  # the master may cut the connection mid-way
    finally:
        s.close()
    _serving(master)


def test_nothing_held_once_the_fuzzers_are_gone(master: MasterService) -> None:
    end = time.monotonic() + 5
    while (master.server.buffered or len(master.server.conns) > 0) and time.monotonic() < end:
        time.sleep(0.05)
    assert master.server.buffered == 0 and not master.server.conns
    _serving(master)
