"""Fixtures of the load generator's tests: a real OpenAI-compatible fake endpoint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai_fake import FakeServer  # tests/bench is on sys.path (rootdir conftest mode)


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    """A started `FakeServer` (127.0.0.1, ephemeral port); its URL is ``fake.url``."""
    server = FakeServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
