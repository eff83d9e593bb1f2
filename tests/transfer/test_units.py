"""Unit tests: slicing, the status machine, batch bookkeeping and the SIEVE endpoint pool."""

from __future__ import annotations

import pytest

from yuebing.core.errors import ConfigError, InputError, TransferError
from yuebing.transfer import (
    BatchId,
    EmbeddedMetadata,
    OpCode,
    TransferConfig,
    TransferEngine,
    TransferRequest,
    TransferStatus,
)
from yuebing.transfer.batch import Batch, RequestState, Slice, split_ranges
from yuebing.transfer.pool import SieveCache

S = TransferStatus


def test_split_ranges_exact() -> None:
    assert split_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert split_ranges(8, 4) == [(0, 4), (4, 4)]
    assert split_ranges(3, 4) == [(0, 3)]
    assert split_ranges(1 << 20, 1 << 20) == [(0, 1 << 20)]
    with pytest.raises(ValueError):
        split_ranges(0, 4)
    with pytest.raises(ValueError):
        split_ranges(4, 0)


def test_status_order_and_terminal() -> None:
    assert S.PENDING < S.TRANSFERRING < S.DONE
    assert [s.terminal for s in S] == [False, False, True, True, True]


def _batch(lengths: list[int], slices: list[int], deadline: float = 100.0) -> Batch:
    reqs = [RequestState(OpCode.WRITE, n, k) for n, k in zip(lengths, slices, strict=True)]
    return Batch(BatchId(7), reqs, deadline)


def test_batch_moves_forward_to_done() -> None:
    b = _batch([8, 4], [2, 1])
    snap = b.snapshot()
    assert snap.status == S.PENDING and [r.status for r in snap.requests] == [S.PENDING] * 2
    b.started(0)
    assert b.snapshot().status == S.PENDING  # least advanced in-flight state
    b.slice_done(0, 4, None)
    b.started(1)
    snap = b.snapshot()
    assert snap.status == S.TRANSFERRING
    assert [(r.status, r.transferred) for r in snap.requests] == [(S.TRANSFERRING, 4),
                                                                 (S.TRANSFERRING, 0)]
    b.slice_done(0, 4, None)
    assert b.snapshot().requests[0].status == S.DONE and not b.event.is_set()
    b.started(0)  # a late "started" never moves a request backwards
    assert b.snapshot().requests[0].status == S.DONE
    b.slice_done(1, 4, None)
    snap = b.snapshot()
    assert snap.status == S.DONE and b.event.is_set()
    assert [r.transferred for r in snap.requests] == [8, 4]
    snap.raise_for_status()


def test_batch_failure_is_sticky_and_reported_once_all_terminal() -> None:
    b = _batch([8, 4], [2, 1])
    b.slice_done(0, 4, "lane broke")
    b.slice_done(0, 4, None)  # a late success of another slice changes nothing
    snap = b.snapshot()
    assert snap.requests[0] == snap.requests[0].__class__(S.FAILED, 0, 8, "lane broke")
    assert snap.status == S.PENDING and not b.event.is_set()
    b.slice_done(1, 4, None)
    snap = b.snapshot()
    assert snap.status == S.FAILED and b.event.is_set()
    assert snap.errors == ["request 0: lane broke"]
    with pytest.raises(TransferError, match="batch 7 FAILED: request 0: lane broke"):
        snap.raise_for_status()


def test_batch_expire_times_out_only_open_requests() -> None:
    b = _batch([4, 4], [1, 1], deadline=10.0)
    b.slice_done(0, 4, None)
    assert not b.expire(9.99)
    assert b.expire(10.5)
    snap = b.snapshot()
    assert [r.status for r in snap.requests] == [S.DONE, S.TIMEOUT]
    assert snap.status == S.TIMEOUT
    assert "deadline passed" in snap.requests[1].error
    assert not b.expire(11.0)  # already terminal


def test_batch_callbacks_run_once_on_completion() -> None:
    b = _batch([4], [1])
    seen: list[TransferStatus] = []
    b.add_callback(lambda batch: seen.append(batch.snapshot().status))
    s = Slice(b, 0, OpCode.WRITE, memoryview(bytearray(4)), "x", 0)
    assert s.live
    s.complete()
    assert not s.live
    b.add_callback(lambda batch: seen.append(batch.snapshot().status))  # already done: at once
    assert seen == [S.DONE, S.DONE]


def test_sieve_evicts_unvisited_and_keeps_visited() -> None:
    evicted: list[str] = []
    c: SieveCache[str, int] = SieveCache(3, on_evict=lambda k, v: evicted.append(k))
    for k in "abc":
        c.get_or_create(k, lambda k=k: ord(k))
    assert c.get("a") == ord("a")  # visited
    c.get_or_create("d", lambda: 4)  # hand: a (visited → cleared), b evicted
    assert evicted == ["b"] and c.keys() == ["a", "c", "d"]
    c.get_or_create("e", lambda: 5)  # hand stays after b's slot: c evicted
    assert evicted == ["b", "c"] and c.keys() == ["a", "d", "e"]
    c.get("d")
    c.get("e")
    c.get_or_create("f", lambda: 6)  # d, e cleared; wraps to a (bit cleared earlier) → a evicted
    assert evicted == ["b", "c", "a"] and c.keys() == ["d", "e", "f"]
    assert c.evictions == 3 and len(c) == 3


def test_sieve_skips_unevictable_and_may_exceed_capacity() -> None:
    busy = {"a"}
    c: SieveCache[str, str] = SieveCache(1, evictable=lambda v: v not in busy)
    c.get_or_create("a", lambda: "a")
    c.get_or_create("b", lambda: "b")  # a is busy: kept, cache over capacity
    assert c.keys() == ["a", "b"]
    busy.clear()
    c.get_or_create("c", lambda: "c")  # now both can go until within capacity
    assert c.keys() == ["c"]


def test_sieve_pop_and_hit_do_not_call_factory() -> None:
    c: SieveCache[str, int] = SieveCache(2)
    assert c.get_or_create("a", lambda: 1) == 1
    assert c.get_or_create("a", lambda: pytest.fail("factory called on a hit")) == 1
    assert c.pop("a") == 1 and c.pop("a") is None and len(c) == 0
    with pytest.raises(ValueError):
        SieveCache(0)


def test_request_validation_errors() -> None:
    with pytest.raises(InputError, match="writable"):
        TransferRequest(OpCode.READ, b"abc", "s", 0).resolve()
    with pytest.raises(InputError, match="exceeds the local buffer"):
        TransferRequest(OpCode.WRITE, b"abc", "s", 0, length=4).resolve()
    with pytest.raises(InputError, match="non-negative"):
        TransferRequest(OpCode.WRITE, b"abc", "s", -1).resolve()
    with pytest.raises(InputError, match="positive"):
        TransferRequest(OpCode.WRITE, b"abc", "s", 0, length=0).resolve()
    with pytest.raises(InputError, match="not a buffer"):
        TransferRequest(OpCode.WRITE, 12, "s", 0).resolve()
    view, n = TransferRequest(OpCode.WRITE, b"abcdef", "s", 0, length=4).resolve()
    assert (bytes(view), n) == (b"abcd", 4)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("lanes", 0, "lanes must be in 1..64 or -1"),
    ("slice_size", 100, "slice_size must be in 4KiB..1GiB"),
    ("timeout_s", 0.0, "timeout_s must be a finite number of seconds > 0"),
    ("timeout_s", float("inf"), "timeout_s must be a finite number of seconds > 0"),
    ("io_timeout_s", float("nan"), "io_timeout_s must be a finite number of seconds > 0"),
    ("transports", ("rdma",), "transports must be"),
    ("metadata", "zookeeper://x", "metadata must be"),
    ("max_endpoints", 0, "max_endpoints must be >= 1"),
])
def test_config_rejects_bad_values(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TransferConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("inf"), float("nan")])
def test_submit_refuses_a_timeout_that_is_not_a_finite_time(timeout: float) -> None:
    """A batch's deadline travels on its write frames as the fence: it must be a real time."""
    with TransferEngine(TransferConfig(engine_id="t"), metadata=EmbeddedMetadata()) as eng:
        eng.register_segment("seg", size=4096)
        with pytest.raises(InputError, match="finite number of seconds"):
            eng.submit([TransferRequest(OpCode.WRITE, b"abc", "seg", 0)], timeout_s=timeout)
