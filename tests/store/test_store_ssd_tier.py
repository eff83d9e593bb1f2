"""The SSD tier with real master and node processes (issue 15 item 8): a node whose DRAM holds a
third of the values and whose SSD holds them all keeps every value put, at a paced rate and at
full speed, and serves every read (promoted, or copied from the SSD file directly)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from store_procs import Proc, store_cluster

from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture()
def tiered(tmp_path, request) -> Iterator[tuple[Proc, Proc]]:
    dram, ssd = request.param
    tier = ("--ssd", f"{tmp_path}:{ssd}")
    with store_cluster("tiered", dram=dram, node_args=tier) as (mst, nd):
        yield mst, nd


def _put_then_get(addr: str, n: int, size: int, rate: float) -> tuple[int, dict[str, float]]:
    """Put ``n`` values of ``size`` bytes (``rate`` per second, 0 = full speed), then get each
    once; returns how many read back exactly, and the master's counters."""
    rng = np.random.default_rng(3)
    vals = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    with StoreClient(ClientConfig(master=addr)) as c:
        start = time.monotonic()
        for i, v in enumerate(vals):
            if rate:
                time.sleep(max(0.0, start + i / rate - time.monotonic()))
            c.put(f"v{i}", v)
        good = sum(c.get(f"v{i}") == v for i, v in enumerate(vals))
        return good, c.stats()


@pytest.mark.parametrize("tiered", [("4MiB", "32MiB")], indirect=True)
@pytest.mark.parametrize("rate", [50.0, 0.0], ids=["paced", "full_speed"])
def test_every_value_put_reads_back_when_the_tiers_have_room(tiered, rate: float) -> None:
    mst, _ = tiered
    good, stats = _put_then_get(mst.info["address"], 200, 64 * KiB, rate)
    assert good == 200
    assert stats["no_space"] == 0 and stats["offloads"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("tiered", [("64MiB", "512MiB")], indirect=True)
@pytest.mark.parametrize("rate", [50.0, 0.0], ids=["paced", "full_speed"])
def test_issue_sizes_200_of_1mib_on_64mib_dram_and_512mib_ssd(tiered, rate: float) -> None:
    mst, _ = tiered
    good, stats = _put_then_get(mst.info["address"], 200, 1 * MiB, rate)
    assert good == 200 and stats["no_space"] == 0
