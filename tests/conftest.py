"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"


@pytest.fixture(scope="session")
def conversation_trace() -> Path:
    """The released Mooncake conversation trace (../shared/traces), or skip if absent."""
    if not TRACE.exists():
        pytest.skip(f"trace not found at {TRACE}")
    return TRACE
