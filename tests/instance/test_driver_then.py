"""`Instance.driver_then`: a driver call's completion handled on the loop without a task — and
a handler that raises ends its task with INTERNAL instead of leaving it hanging (found by the
session review: decode adoption and coupled add had lost `spawn`'s guard)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from yuebing.engine.sampling import SamplingParams
from yuebing.instance.base import Instance, Task
from yuebing.instance.driver import DriverStopped
from yuebing.protocol.instance import ErrorCode


class _Driver:
    """Runs a call at once on the caller's thread (the real one runs it on its own thread)."""

    def call(self, fn: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(None))
        except Exception as e:  # noqa: BLE001 - the future carries it, as EngineDriver's does
            fut.set_exception(e)
        return fut


class _Host:
    driver = _Driver()

    def __init__(self) -> None:
        self.failed: list[tuple[str, ErrorCode, str]] = []

    def fail(self, task: Task, code: ErrorCode, error: str) -> None:
        task.done = True
        self.failed.append((task.request_id, code, error))


def _task(rid: str) -> Task:
    return Task(request_id=rid, owner=b"c", token_ids=[1, 2], params=SamplingParams())


def _run(call: Any, then: Any) -> tuple[_Host, Task]:
    host, task = _Host(), _task("r1")

    async def go() -> None:
        Instance.driver_then(host, task, call, then)  # type: ignore[arg-type]
        for _ in range(3):
            await asyncio.sleep(0)
    asyncio.run(go())
    return host, task


def test_the_result_reaches_the_handler_on_the_loop():
    seen: list[int] = []
    host, task = _run(lambda _e: 41, lambda f: seen.append(f.result() + 1))
    assert seen == [42] and host.failed == [] and not task.done


def test_a_raising_handler_fails_its_task_with_internal():
    def then(_f: concurrent.futures.Future[Any]) -> None:
        raise KeyError("blocks")
    host, task = _run(lambda _e: None, then)
    assert task.done
    assert host.failed == [("r1", ErrorCode.INTERNAL, "KeyError: 'blocks'")]


def test_a_failed_call_reaches_the_handler_as_the_future_exception():
    seen: list[BaseException | None] = []

    def call(_e: object) -> None:
        raise DriverStopped("the engine driver is stopped")
    host, _ = _run(call, lambda f: seen.append(f.exception()))
    assert isinstance(seen[0], DriverStopped) and host.failed == []
