"""`server._race`: the work ends, or the client goes away (cancelling it) — and a watch whose
``receive`` failed counts as gone, before or after the race, without leaving a task exception
unretrieved ("Task exception was never retrieved" in the Conductor's log)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from yuebing.conductor.server import _Disconnected, _race


def _run(main: Any) -> list[dict[str, Any]]:
    errors: list[dict[str, Any]] = []

    async def wrapped() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        await main()
        await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
    asyncio.run(wrapped())
    gc.collect()
    return errors


def test_the_work_wins_while_the_client_stays() -> None:
    async def main() -> None:
        async def receive() -> dict[str, Any]:
            await asyncio.sleep(10)  # a receive that never ends
            return {"type": "http.disconnect"}
        assert await _race(asyncio.sleep(0.01, result=7), receive) == 7
    assert _run(main) == []


def test_a_disconnect_cancels_the_work() -> None:
    async def main() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}
        with pytest.raises(_Disconnected):
            await _race(asyncio.sleep(10), receive)
    assert _run(main) == []


def test_a_failed_receive_is_a_disconnect() -> None:
    async def main() -> None:
        async def receive() -> dict[str, Any]:
            raise OSError("connection reset")
        with pytest.raises(_Disconnected):
            await _race(asyncio.sleep(10), receive)
    assert _run(main) == []


def test_a_watch_that_fails_after_the_race_leaves_no_exception_unretrieved() -> None:
    """The work won; cancelling the watch made its ``receive`` raise (not CancelledError)."""
    async def main() -> None:
        async def receive() -> dict[str, Any]:
            try:
                await asyncio.sleep(10)  # a body that never ends
            except asyncio.CancelledError:
                raise RuntimeError("receive after the response ended") from None
            return {"type": "http.disconnect"}
        assert await _race(asyncio.sleep(0.01, result=3), receive) == 3
        await asyncio.sleep(0.01)  # the watch ends meanwhile
    assert _run(main) == []
