"""What is still queued on an `EngineDriver` when it stops: each call fails with `DriverStopped`,
one its caller cancelled stays cancelled (the drain used to raise `InvalidStateError` in the
driver thread on it and leave the rest unresolved), and a load measurement the report loop left
queued when the instance stopped is not logged as an unread exception (found in an overload
run's decode log)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from typing import Any

import pytest

from yuebing.instance.driver import DriverStopped, EngineDriver
from yuebing.instance.reports import _read_exception


class _Engine:
    """Nothing to step: the driver only runs the calls queued on it."""

    def has_unfinished(self) -> bool:
        return False


def _blocked_driver() -> tuple[EngineDriver, threading.Event]:
    """A driver whose thread is held inside a call until the event is set."""
    release = threading.Event()
    driver = EngineDriver(_Engine(), lambda outs: None)
    started = threading.Event()

    def hold(engine: object) -> None:
        started.set()
        release.wait(10)

    driver.call(hold)
    assert started.wait(10)
    return driver, release


def test_calls_queued_at_the_stop_fail_and_a_cancelled_one_stays_cancelled() -> None:
    driver, release = _blocked_driver()
    cancelled = driver.call(lambda e: 1)
    queued = driver.call(lambda e: 2)
    assert cancelled.cancel()
    closing = threading.Thread(target=driver.close)
    closing.start()
    release.set()
    closing.join(10)
    assert not driver.alive
    assert cancelled.cancelled()
    with pytest.raises(DriverStopped):
        queued.result(timeout=5)


def test_a_measurement_left_queued_at_the_stop_is_not_logged_unread(caplog) -> None:
    async def main(read: bool) -> None:
        driver, release = _blocked_driver()
        fut: asyncio.Future[Any] = asyncio.ensure_future(driver.run(lambda e: 3))
        if read:
            fut.add_done_callback(_read_exception)
        closing = threading.Thread(target=driver.close)
        closing.start()
        release.set()
        await asyncio.to_thread(closing.join, 10)
        while not fut.done():  # fails with DriverStopped; nobody awaits it (the loop is gone)
            await asyncio.sleep(0.01)
        del fut
        gc.collect()

    with caplog.at_level(logging.ERROR):
        asyncio.run(main(read=False))
    assert "exception was never retrieved" in caplog.text  # what the callback is for
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        asyncio.run(main(read=True))
    assert "exception was never retrieved" not in caplog.text
