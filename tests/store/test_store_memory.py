"""Value buffers of bytes-returning reads: no zero-fill, freed memory reused (no page faults)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from yuebing.core.errors import ConfigError
from yuebing.store.client.direct import keep_freed_memory, new_buffer
from yuebing.store.config import ClientConfig


def test_new_buffer_sizes() -> None:
    b = new_buffer(4096)
    assert type(b) is bytearray and len(b) == 4096
    b[:] = b"\x07" * 4096
    assert b == b"\x07" * 4096
    assert new_buffer(0) == bytearray()
    with pytest.raises(ValueError, match="buffer size must be >= 0, got -1"):
        new_buffer(-1)


def test_keep_freed_zero_changes_nothing() -> None:
    assert keep_freed_memory(0) is False


def test_keep_freed_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="--keep-freed must be >= 0 bytes, got -1"):
        ClientConfig(keep_freed=-1)


FAULTS = """
import resource, sys
from yuebing.store.client.direct import keep_freed_memory, new_buffer
if sys.argv[1] == "keep":
    assert keep_freed_memory(1 << 30)
def round_():
    bufs = [new_buffer(4 << 20) for _ in range(16)]
    for b in bufs:
        b[::4096] = b"\\1" * len(range(0, len(b), 4096))
round_()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_value_buffers_are_reused_without_page_faults() -> None:
    """16 x 4 MiB = 16,384 pages: given back to the kernel and faulted in again by default,
    reused from the heap once `keep_freed_memory` is on (a fresh process for each case)."""
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], check=True,
                             capture_output=True, text=True)
        return int(out.stdout.strip())

    assert faults("default") > 10_000
    assert faults("keep") < 500
