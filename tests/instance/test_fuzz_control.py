"""Fuzzing an instance's control socket (hypothesis) in a real process: random bytes, frames of
the wrong shape, and the control messages with arbitrary field values (prompts out of the
vocabulary, NaN temperatures, unknown modes, huge ids...). Every request gets a reply with its
``seq`` — an error with a precise code, never INTERNAL — and the instance keeps serving with no
error in its log. Messages that name peer addresses (prefix plans, decode targets, prefix
fetches) are left out: the instance would dial them, and tests talk to 127.0.0.1 only."""

from __future__ import annotations

import time
import typing
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from instance_procs import TINY, InstanceProc

from fuzz_factories import plain
from yuebing.protocol import decode, encode
from yuebing.protocol.instance import (
    Ack,
    Cancel,
    ErrorCode,
    ErrorReply,
    Hello,
    LoadReport,
    Ping,
    Reserve,
    Sampling,
    SubmitTask,
    Subscribe,
    TaskEvent,
)

REQUESTS = [Ping, Subscribe, Cancel, SubmitTask, Reserve, Hello, Ack, LoadReport, TaskEvent]
"""What a peer may send (and some it should not); none names an address the instance dials."""
NO_ADDRESSES = {"prefix": None, "decode": None}
PUSHES = {"inst.event", "inst.events", "inst.load"}
"""Tags of what an instance pushes on its own (events, batches of them, load reports)."""

ints = st.integers(-(2**63), 2**63 - 1)
scalars = st.none() | st.booleans() | ints | st.floats() | st.text(max_size=10)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def _plain(v: Any) -> Any:
    return plain(v, 2**63 - 1)


sampling = st.builds(Sampling, max_tokens=st.integers(-3, 6), temperature=st.floats(),
                     top_p=st.floats(), top_k=ints, seed=st.none() | ints,
                     stop=st.lists(st.text(max_size=3), max_size=3),
                     stop_token_ids=st.lists(ints, max_size=3), ignore_eos=st.booleans(),
                     min_tokens=st.integers(-2, 8))
token_ids = st.lists(st.integers(-3, 520) | ints, max_size=20)


@st.composite
def requests(draw: st.DrawFn) -> tuple[int, bytes]:
    cls = draw(st.sampled_from(REQUESTS))
    hints = typing.get_type_hints(cls)
    seq = draw(st.integers(1, 2**31))
    body: dict[str, Any] = {"type": cls.__struct_config__.tag, "seq": seq}
    for name in cls.__struct_fields__:
        if name in ("v", "seq") or draw(st.integers(0, 9)) == 0:
            continue
        if name in NO_ADDRESSES:
            body[name] = None
        elif name == "sampling":
            body[name] = draw(sampling | values)
        elif name == "token_ids":
            body[name] = draw(token_ids | values)
        else:
            try:
                typed = st.from_type(hints[name])
            except Exception:  # noqa: BLE001 - a type hypothesis cannot build
                typed = values
            body[name] = draw(typed | values)
    return seq, msgspec.msgpack.encode(_plain(body))


@pytest.fixture(scope="module")
def instance() -> Iterator[tuple[InstanceProc, zmq.Socket]]:
    p = InstanceProc("coupled", TINY, "--num-blocks", "64", "--max-model-len", "256")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(p.address)
    yield p, sock
    sock.close()
    ctx.term()
    p.stop()


def _reply(sock: zmq.Socket, seq: int, timeout_s: float = 10.0) -> Any:
    """The reply to the request just sent: with its ``seq``, or an `ErrorReply` with seq 0 (a
    request that did not decode has no seq the instance could know); events and reports
    pushed meanwhile are skipped."""
    end = time.monotonic() + timeout_s
    while sock.poll(max(1, int((end - time.monotonic()) * 1000))):
        frames = sock.recv_multipart()
        assert len(frames) == 1, frames
        msg = decode(frames[0])
        if type(msg).__struct_config__.tag in PUSHES:
            continue
        if msg.seq == seq or (isinstance(msg, ErrorReply) and msg.seq == 0):
            return msg
    return None


def _serving(sock: zmq.Socket) -> None:
    sock.send(encode(Ping(seq=1)))
    assert isinstance(_reply(sock, 1), Ack)


fuzz = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@fuzz
@given(req=requests())
def test_random_control_messages_get_a_precise_reply(instance: tuple[InstanceProc, zmq.Socket],
                                                     req: tuple[int, bytes]) -> None:
    _, sock = instance
    seq, payload = req
    sock.send(payload)
    reply = _reply(sock, seq)
    assert reply is not None, msgspec.msgpack.decode(payload)
    if isinstance(reply, ErrorReply):
        assert reply.code != ErrorCode.INTERNAL and reply.message, reply


@fuzz
@given(frames=st.lists(st.binary(max_size=40), min_size=1, max_size=3))
def test_garbage_frames_are_refused_or_dropped(instance: tuple[InstanceProc, zmq.Socket],
                                               frames: list[bytes]) -> None:
    _, sock = instance
    sock.send_multipart(frames)
    if len(frames) == 1:  # one frame that is no message: BAD_REQUEST with seq 0
        reply = _reply(sock, 0)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.BAD_REQUEST, reply
    _serving(sock)


def test_still_serving_and_no_error_logged(instance: tuple[InstanceProc, zmq.Socket]) -> None:
    p, sock = instance
    _serving(sock)
    log = p.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "control request failed" not in log, log[-3000:]
