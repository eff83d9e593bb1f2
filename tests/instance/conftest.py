"""Shared fixtures of the instance tests: real instance processes over the dummy model."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from instance_procs import TINY, InstanceProc  # noqa: E402

PINNED = ("--dtype", "float32", "--kv-cache-bytes", "64MiB",
          "--max-batch-tokens", "256", "--no-warmup")
"""Every test instance computes the same KV as the in-process reference engine."""


@pytest.fixture(scope="module")
def procs(request):
    """Started lazily: ``procs("prefill", *flags)``; all stopped at the end of the module."""
    started: list[InstanceProc] = []

    def start(role: str, *extra: str, model: str = TINY) -> InstanceProc:
        p = InstanceProc(role, model, *PINNED, *extra)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def run():
    """Run a coroutine to completion in a fresh event loop (zmq.asyncio needs one)."""
    def go(coro):
        return asyncio.run(coro)
    return go
