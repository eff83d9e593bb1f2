"""Fixtures for engine tests."""

from __future__ import annotations

import pytest
from engine_factories import tiny

from yuebing.engine.weights import LoadedWeights


@pytest.fixture(scope="session")
def tiny_weights() -> LoadedWeights:
    """Deterministic random weights of a 2-layer GQA model (vocab 256)."""
    return tiny()
