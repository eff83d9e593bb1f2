"""Test factories: real instance processes (``yuebing serve <role>``) on 127.0.0.1 and asyncio
helpers that drive them through `InstanceClient` the way the Conductor does."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from cli_procs import CliProc
from yuebing.instance.client import InstanceClient
from yuebing.protocol.instance import (
    EventKind,
    LoadReport,
    PrefixPlan,
    Sampling,
    SubmitTask,
    TaskEvent,
    TaskMode,
)

TINY = "dummy:preset=tiny,vocab=512,layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,ctx=4096,tie=0"
"""A small dummy model whose greedy tokens vary (the bare tiny preset repeats one token)."""


class InstanceProc(CliProc):
    """One ``yuebing serve <role>`` process; ``hello`` is the Hello it wrote when ready."""

    def __init__(self, role: str, model: str = TINY, *extra: str, timeout_s: float = 120.0
                 ) -> None:
        self.role = role
        super().__init__(["serve", role, "--model", model, "--report-hz", "20",
                          "--no-startup-profile", *extra],
                         name=role, timeout_s=timeout_s)
        self.hello = self.info
        self.address: str = self.hello["control_address"]


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    events: list[TaskEvent] = field(default_factory=list)
    finish: str | None = None
    error: str = ""
    cached_tokens: int = 0


async def collect(client: InstanceClient, rid: str, res: Result) -> Result:
    async for ev in client.events(rid):
        res.events.append(ev)
        res.tokens += ev.token_ids
        res.cached_tokens = max(res.cached_tokens, ev.cached_tokens)
        if ev.kind == EventKind.ERROR:
            res.error = ev.error
        elif ev.kind == EventKind.FINISH:
            res.finish = ev.finish_reason
    return res


async def run_disagg(p: InstanceClient, d: InstanceClient, rid: str, ids: list[int],
                     sampling: Sampling, prefix: PrefixPlan | None = None) -> Result:
    """Reserve on the decode, prefill with streaming, then the decode's tokens."""
    r = await d.reserve(rid, ids, sampling, timeout_s=900)  # a busy test machine prefills slowly
    await p.submit(SubmitTask(seq=0, request_id=rid, token_ids=ids, sampling=sampling,
                              mode=TaskMode.PREFILL, prefix=prefix, decode=r.target))
    res = await collect(p, rid, Result())
    if res.error:
        await d.cancel(rid)
        return res
    assert res.finish == "handoff", res
    return await collect(d, rid, res)


async def run_coupled(c: InstanceClient, rid: str, ids: list[int], sampling: Sampling,
                      prefix: PrefixPlan | None = None) -> Result:
    await c.submit(SubmitTask(seq=0, request_id=rid, token_ids=ids, sampling=sampling,
                              mode=TaskMode.COUPLED, prefix=prefix))
    return await collect(c, rid, Result())


class Reports:
    """Keeps the `LoadReport`s of an instance (``last``: the latest)."""

    def __init__(self) -> None:
        self.last: LoadReport | None = None
        self.all: list[LoadReport] = []
        self.count = 0
        self.gaps = 0
        """Reports whose sequence number was not the previous one's + 1."""

    def __call__(self, r: LoadReport) -> None:
        if self.last is not None and r.report_seq != self.last.report_seq + 1:
            self.gaps += 1
        self.all.append(r)
        self.last, self.count = r, self.count + 1

    async def wait(self, pred, timeout_s: float = 10.0) -> LoadReport:  # type: ignore[no-untyped-def]
        """The latest report, once one received after this call satisfies ``pred`` (a state
        the instance settles in)."""
        end = time.monotonic() + timeout_s
        n = self.count
        while time.monotonic() < end:
            if self.last is not None and self.count > n and pred(self.last):
                return self.last
            await asyncio.sleep(0.02)
        raise AssertionError(f"no report matched within {timeout_s}s; last: {self.last}")

    async def seen(self, pred, timeout_s: float = 10.0) -> LoadReport:  # type: ignore[no-untyped-def]
        """The first report received after this call that satisfies ``pred``, each one
        checked: a passing state (a prefill running) is found even when a starved test
        process reads several reports at once and the latest shows it over."""
        end = time.monotonic() + timeout_s
        n = self.count
        while True:
            for r in self.all[n:self.count]:
                if pred(r):
                    return r
            n = self.count
            if time.monotonic() >= end:
                raise AssertionError(f"no report matched within {timeout_s}s; last: {self.last}")
            await asyncio.sleep(0.02)
