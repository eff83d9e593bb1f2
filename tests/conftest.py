"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
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


@pytest.fixture(scope="session", autouse=True)
def machine_choices() -> None:
    """This machine's transfer choices (TCP lanes, small-copy and split limits) settled once
    before any test: on a machine that has not measured them yet, the first engine a test
    starts (maybe in a child process, under a test's short timeouts) would measure them
    instead. From then on kept choices are used as they are, provisional ones too
    (`core.choices`): a quiet moment mid-test must not start a measurement."""
    from yuebing.core import env
    from yuebing.store.client import direct
    from yuebing.transfer import TransferConfig, TransferEngine, streamcopy
    from yuebing.transfer.lanes import resolve_lanes

    resolve_lanes(TransferConfig(), TransferEngine)
    streamcopy.small_copy()
    direct.split_limits(direct.default_workers(), wait=True)
    os.environ[env.KEEP_CHOICES] = "1"


@pytest.fixture(scope="session", autouse=True)
def session_learned_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Clusters of module- and session-scoped fixtures (started before any test's own
    directory) keep what their Conductors learn here, never in the user's cache."""
    path = tmp_path_factory.mktemp("learned")
    before = os.environ.get("YUEBING_LEARNED_DIR")
    os.environ["YUEBING_LEARNED_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("YUEBING_LEARNED_DIR", None)
    else:
        os.environ["YUEBING_LEARNED_DIR"] = before


@pytest.fixture(autouse=True)
def learned_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's Conductors (and those of the clusters it starts) keep what they learn
    (`conductor.learned`) in its own directory: one test's tail must not start the next's."""
    path = tmp_path / "learned"
    monkeypatch.setenv("YUEBING_LEARNED_DIR", str(path))
    return path
