"""Fixtures for engine tests."""

from __future__ import annotations

import shutil

import pytest
from engine_factories import tiny

from yuebing.engine import native
from yuebing.engine.weights import LoadedWeights


@pytest.fixture(scope="session")
def tiny_weights() -> LoadedWeights:
    """Deterministic random weights of a 2-layer GQA model (vocab 256)."""
    return tiny()


@pytest.fixture(scope="module")
def native_kernels() -> None:
    """Build/load the native kernels; a machine with a C++ compiler must be able to build them
    (skips where there is none). Test modules of the kernels use it autouse-style through
    ``pytestmark = pytest.mark.usefixtures("native_kernels")``."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    result = native.load()
    assert result.ok, result.error
