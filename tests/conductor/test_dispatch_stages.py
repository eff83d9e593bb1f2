"""The Conductor over a fake pipeline group (stages ``0:2`` and ``2:4`` of group ``g``, a decode)
speaking the real control protocol: a store prefix the range index names but a stage finds
evicted is recomputed on a re-dispatch, not a failed request; a group request queues at every
stage's gate."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fake_instance import FINGERPRINT, FakeLoop
from harness import MODEL, ConductorThread, request

from yuebing.instance.kvkeys import store_block_keys
from yuebing.protocol.instance import Role, SubmitTask

PROMPT = list(range(1, 701))  # 2 full store blocks of 256 tokens, then 188 more


@pytest.fixture
def fl() -> Iterator[FakeLoop]:
    loop = FakeLoop()
    yield loop
    loop.close()


def _group(fl: FakeLoop) -> ConductorThread:
    fl.add(Role.PREFILL, "s0", layers="0:2", group="g")
    fl.add(Role.PREFILL, "s1", layers="2:4", group="g")
    d0 = fl.add(Role.DECODE, "d0")
    c = ConductorThread(instances=tuple(fl.fakes[n].address for n in ("s0", "s1", "d0")),
                        heartbeat_timeout_s=4.0, cpp_threshold_tokens=300)
    c.wait_ready()
    end = time.monotonic() + 10
    while request(c.url, "GET", "/health")[1]["groups"] != {"g": ["s0", "s1"]}:
        assert time.monotonic() < end, request(c.url, "GET", "/health")[1]
        time.sleep(0.05)
    assert d0.name == "d0"
    return c


def _index_ranges(c: ConductorThread, keys: list[int]) -> None:
    """The range index names both stages' objects of ``keys`` (as the store's events would;
    no request is in flight, so the Conductor's loop reads nothing meanwhile)."""
    for r in ("0:2", "2:4"):
        c.conductor.cluster.ranges.add(r, keys)


def test_an_evicted_stage_prefix_is_recomputed_on_a_redispatch(fl: FakeLoop) -> None:
    c = _group(fl)
    try:
        s0, s1 = fl.fakes["s0"], fl.fakes["s1"]
        s1.missing_prefix = True  # evicted between the Conductor's look and s1's load
        _index_ranges(c, store_block_keys(PROMPT, 256, FINGERPRINT))
        status, body = request(c.url, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert status == 200, body
        ext = body["usage"]["yuebing"]
        assert (ext["prefill_instance"], ext["redispatched"]) == ("g", 1)
        tasks = [s1.kinds(SubmitTask), s0.kinds(SubmitTask)]
        for t in tasks:  # first with the 512-token store prefix, then recomputing it
            assert [x.stage.prefix_tokens for x in t] == [512, 0]
            assert [x.prefix.tokens if x.prefix else 0 for x in t] == [512, 0]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        c.stop()


def test_the_prefill_pool_load_counts_the_stages(fl: FakeLoop) -> None:
    """Stage s0 reports 10 s of queued prefill (10,000 tokens at 1,000 tokens/s): the prefill
    pool's load is the stages' mean over the TTFT SLO."""
    fl.add(Role.PREFILL, "s0", layers="0:2", group="g", queued_prefill_tokens=10_000,
           prefill_tokens_per_s=1000.0)
    fl.add(Role.PREFILL, "s1", layers="2:4", group="g")
    fl.add(Role.DECODE, "d0")
    c = ConductorThread(instances=tuple(fl.fakes[n].address for n in ("s0", "s1", "d0")),
                        heartbeat_timeout_s=4.0, cpp_threshold_tokens=300, ttft_slo_s=20.0)
    try:
        c.wait_ready()
        end = time.monotonic() + 10
        while (pools := request(c.url, "GET", "/health")[1]["pools"])["prefill"] == 0:
            assert time.monotonic() < end, pools
            time.sleep(0.05)
        assert pools["prefill"] == pytest.approx(10.0 / 2 / 20.0, rel=0.05)
    finally:
        c.stop()
