"""A control request that races the instance's shutdown (its engine driver already stopped) is
answered SHUTTING_DOWN, without a traceback in the log (found in an overload run's decode log:
the Conductor's cancels of a cut run reached a decode that was stopping)."""

from __future__ import annotations

import asyncio
import logging

from yuebing.instance.config import InstanceConfig
from yuebing.instance.control import ControlServer
from yuebing.instance.driver import DriverStopped
from yuebing.protocol import Message, encode
from yuebing.protocol.instance import Cancel, ErrorCode, ErrorReply


def answer(error: Exception) -> list[tuple[bytes, Message]]:
    """What the control server sends for a `Cancel` whose handling raises ``error``."""
    async def dispatch(ident: bytes, msg: Message) -> Message | None:
        raise error

    sent: list[tuple[bytes, Message]] = []
    server = ControlServer(InstanceConfig(), dispatch, lambda ident: None)
    server.send = lambda ident, msg: sent.append((ident, msg))
    asyncio.run(server._handle([b"c1", encode(Cancel(seq=7, request_id="r1"))]))
    return sent


def test_a_cancel_reaching_a_stopped_driver_is_answered_shutting_down(caplog) -> None:
    with caplog.at_level(logging.INFO):
        sent = answer(DriverStopped("the engine driver stopped"))
    assert sent == [(b"c1", ErrorReply(seq=7, code=ErrorCode.SHUTTING_DOWN,
                                       message="the engine driver stopped"))]
    assert "Traceback" not in caplog.text and "control request failed" not in caplog.text


def test_any_other_failure_is_still_logged_as_internal(caplog) -> None:
    sent = answer(RuntimeError("boom"))
    assert [m.code for _, m in sent] == [ErrorCode.INTERNAL]
    assert "control request failed" in caplog.text
