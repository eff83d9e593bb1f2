"""Fuzzing a transfer engine's TCP data port (hypothesis; issue 16): garbage bytes, frames that
do not decode, and well-formed transfer frames (`Hello`, `WriteSlices`, `ReadSlices`, `Notify`)
with arbitrary fields and payloads, each on its own connection. The target keeps serving — a
healthy engine's write and read of its segment still succeed after every example — answers
what it can with a precise error, and its connection threads end with their connections
(nothing a peer announces is kept)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yuebing.protocol.transfer import Hello, Notify, ReadSlices, WriteSlices
from yuebing.transfer import (
    EmbeddedMetadata,
    OpCode,
    TransferConfig,
    TransferEngine,
    TransferRequest,
    TransferStatus,
)
from yuebing.transfer.transport.framing import pack

SEG = 1 << 20
ints = st.integers(-(2**63), 2**63 - 1) | st.integers(0, 2 * SEG)
slices = st.lists(st.tuples(ints, ints, ints, ints), max_size=6)
times = st.floats(allow_nan=True, allow_infinity=True) | st.just(time.time() + 30)


def _frames(name: str) -> st.SearchStrategy[bytes]:
    """One connection's bytes: garbage, a length prefix with garbage, or Hello + messages."""
    msgs = st.one_of(
        st.builds(WriteSlices, id=ints, segment=st.just(name) | st.text(max_size=8),
                  slices=slices, expiry=times),
        st.builds(ReadSlices, id=ints, segment=st.just(name) | st.text(max_size=8),
                  slices=slices),
        st.builds(Notify, id=ints, sender=st.text(max_size=8), topic=st.text(max_size=8),
                  payload=st.binary(max_size=64)))
    hello = pack(Hello(engine_id="fuzz", host_id="fuzz-host"))
    framed = st.builds(lambda ms, tail: hello + b"".join(pack(m) for m in ms) + tail,
                       st.lists(msgs, min_size=1, max_size=3), st.binary(max_size=4096))
    prefixed = st.builds(lambda n, body: n.to_bytes(4, "little") + body,
                         st.integers(0, 2**32 - 1), st.binary(max_size=256))
    return st.binary(max_size=512) | prefixed | framed


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[TransferEngine, TransferEngine, str, tuple[str, int]]]:
    meta = EmbeddedMetadata()
    cfg = TransferConfig(transports=("tcp",), lanes=1, io_timeout_s=0.5)
    tgt = TransferEngine(cfg, metadata=meta)
    tgt.register_segment("seg", size=SEG)
    name = tgt.segment_name("seg")
    cli = TransferEngine(cfg, metadata=meta)
    desc = meta.lookup(name)
    assert desc is not None
    host, port = desc.address.rsplit(":", 1)
    yield tgt, cli, name, (host.removeprefix("tcp://"), int(port))
    cli.close()
    tgt.close()


def _healthy(cli: TransferEngine, name: str) -> None:
    data = bytes(range(256)) * 16
    st_w = cli.transfer([TransferRequest(OpCode.WRITE, data, name, SEG - 4096)], timeout_s=10)
    back = bytearray(len(data))
    st_r = cli.transfer([TransferRequest(OpCode.READ, back, name, SEG - 4096)], timeout_s=10)
    assert st_w.status == st_r.status == TransferStatus.DONE and bytes(back) == data


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_the_data_port_survives_arbitrary_peers(target, data) -> None:
    _tgt, cli, name, addr = target
    blob = data.draw(_frames(name))
    with socket.create_connection(addr, timeout=2) as s:
        try:
            s.sendall(blob)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(1.0)
            while s.recv(65536):  # whatever it answers, until it closes
                pass
        except OSError:
            pass  # the target closed on us mid-send: allowed
    _healthy(cli, name)


def test_connection_threads_end_with_their_connections(target) -> None:
    _tgt, cli, name, addr = target
    before = threading.active_count()
    for _ in range(20):
        with socket.create_connection(addr, timeout=2) as s:
            s.sendall((2**31).to_bytes(4, "little") + b"x" * 10)  # a huge header announced
    end = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < end:
        time.sleep(0.05)
    assert threading.active_count() <= before
    _healthy(cli, name)


def test_a_bad_write_gets_a_precise_error_and_writes_nothing(target) -> None:
    from yuebing.protocol.transfer import HelloReply, SlicesDone
    from yuebing.transfer.transport.framing import recv_frame

    _tgt, cli, name, addr = target
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(pack(Hello(engine_id="fuzz", host_id="fuzz-host")))
        assert isinstance(recv_frame(s), HelloReply)
        for seg, sl, why in (("nope", (0, 8, 0, 8), "nope"),
                             (name, (SEG - 4, 8, SEG - 4, 8), "outside segment")):
            s.sendall(pack(WriteSlices(id=7, segment=seg, slices=[sl],
                                       expiry=time.time() + 30)) + b"z" * 8)
            done = recv_frame(s)
            assert isinstance(done, SlicesDone) and done.id == 7
            assert why in done.errors[0], done.errors
    tail = bytearray(4)
    st_r = cli.transfer([TransferRequest(OpCode.READ, tail, name, SEG - 4)], timeout_s=10)
    assert st_r.status == TransferStatus.DONE and bytes(tail) != b"zzzz"
    _healthy(cli, name)
