"""Same-host fast path pieces without processes: the liveness lock and the copies."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time

import numpy as np
import pytest

from yuebing.store.client.direct import _copy
from yuebing.transfer import OpCode, streamcopy
from yuebing.transfer.liveness import MappedFile


def hold_liveness_lock(path: str) -> int:
    """Lock ``path`` as its owner does (`liveness.create_owned_file`); the fd holds the lock."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


SMALL_COPY = streamcopy.small_copy()
"""This machine's small-copy limit of writes: copies above it stream."""
READ_LIMIT = streamcopy.small_copy(read=True)
"""The same of reads."""


def test_liveness_lock_and_copies_both_ways(tmp_path) -> None:
    path = tmp_path / "seg"
    size = 2 * SMALL_COPY
    path.write_bytes(bytes(size))
    mapped = MappedFile(str(path), size)
    try:
        assert mapped.owner_alive() is False  # nobody holds the file: treated as a dead node
        fd = hold_liveness_lock(str(path))
        assert mapped.owner_alive() is True
        big = np.arange(SMALL_COPY + 1, dtype=np.uint32).view(np.uint8)[:SMALL_COPY + 1]
        later = time.monotonic() + 30
        # past its deadline a write copies nothing (the write fence); a read is not fenced
        assert _copy(OpCode.WRITE, memoryview(b"late!"), mapped, 0, 5, time.monotonic()) == 0
        assert _copy(OpCode.WRITE, memoryview(big), mapped, 10, big.nbytes, later) == big.nbytes
        _copy(OpCode.WRITE, memoryview(b"hello"), mapped, 0, 5, later)  # memoryview path
        out = bytearray(big.nbytes)
        _copy(OpCode.READ, memoryview(out), mapped, 10, big.nbytes, 0.0)
        small = bytearray(5)
        _copy(OpCode.READ, memoryview(small), mapped, 0, 5, 0.0)
        assert bytes(out) == big.tobytes() and small == b"hello"
        os.close(fd)
        assert mapped.owner_alive() is False
    finally:
        mapped.close()
    assert path.read_bytes()[:5] == b"hello"
    assert path.read_bytes()[10:10 + big.nbytes] == big.tobytes()


class _Desc:
    def __init__(self, path: str, size: int) -> None:
        self.shm_path, self.host_id, self.size = path, "here", size


class _Engine:
    """What `DirectSegments` asks of the transfer engine: transports and segment descriptors."""

    host_id = "here"

    def __init__(self, path: str, size: int) -> None:
        self.config = type("Cfg", (), {"transports": ("shm", "tcp")})()
        self.desc = _Desc(path, size)

    def describe(self, segment: str) -> _Desc:
        return self.desc


def test_a_read_ending_past_its_deadline_is_not_trusted(tmp_path) -> None:
    """A direct read that ends past its deadline (the read lease, less a margin) reports
    TIMEOUT — the lease may have ended mid-copy and the range hold another value — so the
    client asks for the replicas again; one within its deadline is DONE."""
    from yuebing.store.client.direct import LATE_READ, DirectSegments
    from yuebing.transfer import TransferRequest, TransferStatus

    path = tmp_path / "seg"
    size = 4 * READ_LIMIT
    path.write_bytes(bytes(range(256)) * (size // 256))
    fd = hold_liveness_lock(str(path))
    direct = DirectSegments(_Engine(str(path), size))  # type: ignore[arg-type]
    try:
        for n in (5, 2 * READ_LIMIT):  # memoryview and streamed copies
            out = bytearray(n)
            req = TransferRequest(OpCode.READ, memoryview(out), "seg", 256, n)
            (late,) = direct.copy([req], time.monotonic() - 1e-3)
            assert late is not None and late.status == TransferStatus.TIMEOUT
            assert late.error == LATE_READ
            (ok,) = direct.copy([req], time.monotonic() + 30)
            assert ok is not None and ok.status == TransferStatus.DONE
            assert bytes(out) == path.read_bytes()[256:256 + n]
    finally:
        direct.close()
        os.close(fd)


def test_a_large_single_read_is_cut_into_pieces_copied_by_several_threads(
        tmp_path, monkeypatch) -> None:
    """One read of the machine's split limit or more is copied by the pool's threads too, piece
    by piece, and lands whole (odd sizes and offsets included); a smaller one stays in the
    caller."""
    from yuebing.store.client import direct as direct_mod
    from yuebing.store.client.direct import DirectSegments, _pieces
    from yuebing.transfer import TransferRequest, TransferStatus

    SPLIT_READ_MIN = 1 << 20
    _settle(monkeypatch, direct_mod.SplitLimits(4 << 20, SPLIT_READ_MIN, SPLIT_READ_MIN))

    for n, k in ((SPLIT_READ_MIN + 4099, 2), (SPLIT_READ_MIN, 4), (5000, 4), (1, 3)):
        job = (OpCode.READ, memoryview(bytearray(n)), None, 7, n)
        pieces = _pieces(job, k)  # type: ignore[arg-type]
        assert 1 <= len(pieces) <= k and sum(p[4] for p in pieces) == n
        starts = [7 + sum(q[4] for q in pieces[:i]) for i in range(len(pieces))]
        assert [p[3] for p in pieces] == starts
        assert all(len(p[1]) == p[4] for p in pieces)
    size = 4 * SPLIT_READ_MIN
    path = tmp_path / "seg"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    fd = hold_liveness_lock(str(path))
    direct = DirectSegments(_Engine(str(path), size))  # type: ignore[arg-type]
    direct.workers = 2
    try:
        small = bytearray(4096)
        direct.copy([TransferRequest(OpCode.READ, memoryview(small), "seg", 0, 4096)],
                    time.monotonic() + 30)
        assert direct._pool is None  # a small read: this thread alone
        n = SPLIT_READ_MIN + 4099
        out = bytearray(n)
        (ok,) = direct.copy([TransferRequest(OpCode.READ, memoryview(out), "seg", 333, n)],
                            time.monotonic() + 30)
        assert ok is not None and ok.status == TransferStatus.DONE and ok.transferred == n
        assert direct._pool is not None  # the other piece went to a pool thread
        assert bytes(out) == path.read_bytes()[333:333 + n]
    finally:
        direct.close()
        os.close(fd)


def test_a_node_dying_during_a_copy_fails_it_alone_or_in_a_batch(tmp_path) -> None:
    """A copy whose node let go of the segment (died) while it ran ends FAILED, never DONE: a
    single request (its own path) and each request of a batch to that segment alike; out of
    range, a request is left to the engine (None)."""
    from yuebing.store.client.direct import DirectSegments
    from yuebing.transfer import TransferRequest, TransferStatus

    path = tmp_path / "seg"
    size = 1 << 20
    path.write_bytes(bytes(size))
    for count in (1, 2):
        fd = hold_liveness_lock(str(path))
        held = [fd]  # until the "node" lets go (closed once: the number may be reused after)
        direct = DirectSegments(_Engine(str(path), size))  # type: ignore[arg-type]
        run = direct._run

        def dying(jobs, deadline, held=held, run=run):  # the node exits mid-copy
            os.close(held.pop())
            return run(jobs, deadline)

        direct._run = dying  # type: ignore[method-assign]
        try:
            far = TransferRequest(OpCode.READ, memoryview(bytearray(8)), "seg", size, 8)
            assert direct.copy([far], time.monotonic() + 30) == [None]  # no copy ran
            reqs = [TransferRequest(OpCode.READ, memoryview(bytearray(4096)), "seg", 4096 * i,
                                    4096) for i in range(count)]
            done = direct.copy(reqs, time.monotonic() + 30)
            assert [d.status if d else None for d in done] == [TransferStatus.FAILED] * count
            assert all(d is not None and d.transferred == 0 and "seg" in (d.error or "")
                       for d in done)
        finally:
            direct.close()
            for left in held:  # a failure before the copy ran: the lock is still ours
                with contextlib.suppress(OSError):
                    os.close(left)


def test_split_limits_are_measured_per_machine_and_kept(tmp_path, monkeypatch) -> None:
    """The limits come from timing whole and split copies of each kind (each limit a
    candidate size or `NEVER`), are kept for the next process under the machine's key, and a
    malformed kept choice is refused."""
    from yuebing.core import choices
    from yuebing.store.client import direct as direct_mod

    limits, timings = direct_mod.measure_split(2, reps=2, arena=64 << 20)
    allowed = {*direct_mod.SPLIT_CANDIDATES, direct_mod.NEVER}
    assert set(limits) <= allowed
    assert set(timings) == set(direct_mod.KINDS)
    assert all(len(t) == 2 and min(t) > 0 for d in timings.values() for t in d.values())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # choices kept under tmp_path
    monkeypatch.setattr(direct_mod, "_split", direct_mod._Split())
    monkeypatch.setattr(choices, "host_busy", lambda: 0.0)
    calls = []
    want = direct_mod.SplitLimits(8 << 20, direct_mod.NEVER, 1 << 20)
    monkeypatch.setattr(direct_mod, "measure_split",
                        lambda w: calls.append(w) or (want, timings))
    assert direct_mod.split_limits(2, wait=True) == want
    monkeypatch.setattr(direct_mod, "_split", direct_mod._Split())  # a new process: kept
    assert direct_mod.split_limits(2) == want and calls == [2]
    mb = 1 << 20
    assert direct_mod.split_choice([[mb, mb, mb], timings])[0] == (mb, mb, mb)
    for bad in ([[0, mb, mb], timings], [["x", mb, mb], timings], [[mb, mb], timings],
                [[True, mb, mb], timings], [[mb + 1, mb, mb], timings], [[mb, mb, mb], []],
                [[mb, mb, mb], {"write": timings["write"]}]):
        with pytest.raises(TypeError):
            direct_mod.split_choice(bad)


def _settle(monkeypatch: pytest.MonkeyPatch, limits: object) -> None:
    """This process's split limits settled as ``limits`` for one test."""
    from yuebing.store.client import direct as direct_mod

    split = direct_mod._Split()
    split.limits = limits  # type: ignore[assignment]
    monkeypatch.setattr(direct_mod, "_split", split)


def test_an_async_client_start_does_not_wait_for_the_split_measurement(tmp_path,
                                                                        monkeypatch) -> None:
    """With nothing kept for this machine, a `DirectSegments` that does not wait (an
    `AsyncStoreClient`'s) starts at once and its copies use `WHOLE` while the limits are
    measured in the background, then the measured ones; one that waits (a `StoreClient`'s)
    gets them settled; a failed measurement leaves copies whole; a provisional (busy) kept
    choice is used while it is measured again, or as it is with `YUEBING_KEEP_CHOICES`."""
    from yuebing.core import choices, env
    from yuebing.store.client import direct as direct_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(env.KEEP_CHOICES, raising=False)
    monkeypatch.setattr(choices, "host_busy", lambda: 0.0)
    monkeypatch.setattr(direct_mod, "_split", direct_mod._Split())
    go, started = threading.Event(), threading.Event()
    want = direct_mod.SplitLimits(4 << 20, direct_mod.NEVER, 2 << 20)
    timings = {k: {str(n): [1.0, 2.0] for n in direct_mod.SPLIT_CANDIDATES}
               for k in direct_mod.KINDS}
    calls: list[int] = []

    def slow(workers: int) -> tuple[direct_mod.SplitLimits, dict]:
        calls.append(workers)
        started.set()
        assert go.wait(30)
        return want, timings

    monkeypatch.setattr(direct_mod, "measure_split", slow)
    monkeypatch.setattr(direct_mod, "default_workers", lambda: 2)
    path = tmp_path / "seg"
    path.write_bytes(bytes(1 << 20))
    fd = hold_liveness_lock(str(path))
    segs = direct_mod.DirectSegments(_Engine(str(path), 1 << 20), wait=False)  # type: ignore[arg-type]
    try:
        assert started.wait(30)
        assert direct_mod.split_limits(2) == direct_mod.WHOLE  # measuring: not waited on
        go.set()
        assert direct_mod.split_limits(2, wait=True) == want and calls == [2]
    finally:
        go.set()
        segs.close()
        os.close(fd)

    monkeypatch.setattr(direct_mod, "_split", direct_mod._Split())  # kept now: at once
    assert direct_mod.split_limits(2) == want and calls == [2]

    def broken(workers: int) -> tuple[direct_mod.SplitLimits, dict]:
        calls.append(-1)
        raise MemoryError("no arena")

    monkeypatch.setattr(direct_mod, "measure_split", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    monkeypatch.setattr(direct_mod, "_split", direct_mod._Split())
    assert direct_mod.split_limits(2, wait=True) == direct_mod.WHOLE and calls == [2, -1]

    # a choice kept from a busy host: used at once, measured again in the background
    kept = choices.choice_dir() / f"{choices.choice_key(direct_mod._split_parts(2))}.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({"value": [list(want), timings], "quiet": False}))
    monkeypatch.setenv(env.KEEP_CHOICES, "1")  # ... unless kept choices are kept as they are
    monkeypatch.setattr(direct_mod, "_split", direct_mod._Split())
    assert direct_mod.split_limits(2) == want and direct_mod._split.thread is None
    monkeypatch.delenv(env.KEEP_CHOICES)
    monkeypatch.setattr(direct_mod, "_split", direct_mod._Split())
    quiet = direct_mod.SplitLimits(1 << 20, 1 << 20, 1 << 20)
    go.clear()
    monkeypatch.setattr(direct_mod, "measure_split", lambda w: go.wait(30) and (quiet, timings))
    assert direct_mod.split_limits(2) == want
    go.set()
    assert direct_mod.split_limits(2, wait=True) == quiet
    assert json.loads(kept.read_text())["quiet"] is True


def test_a_destination_not_faulted_in_takes_the_fresh_limit(tmp_path, monkeypatch) -> None:
    """`resident` tells a new anonymous mapping's pages (not in memory) from touched ones, and
    a batch read into new buffers splits from the ``fresh`` limit while the same batch into
    touched buffers stays whole below the ``batch`` limit."""
    import mmap

    from yuebing.store.client import direct as direct_mod
    from yuebing.store.client.direct import DirectSegments

    new = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = np.frombuffer(new, np.uint8).ctypes.data
    if direct_mod.resident(addr + (512 << 10)):
        pytest.skip("this kernel reports untouched pages resident (no mincore residency)")
    new[512 << 10] = 1
    assert direct_mod.resident(addr + (512 << 10))
    _settle(monkeypatch, direct_mod.SplitLimits(direct_mod.NEVER, direct_mod.NEVER, 1 << 20))
    path = tmp_path / "seg"
    path.write_bytes(bytes(range(256)) * (16 << 12))  # 16 MiB
    mapped = direct_mod.MappedFile(str(path), 4 << 20)
    split: list[int] = []
    d = DirectSegments.__new__(DirectSegments)
    d.workers, d._pool = 2, None
    monkeypatch.setattr(DirectSegments, "_parallel",
                        lambda self, jobs, dl: split.append(len(jobs)) or
                        [direct_mod._copy(*j, dl) for j in jobs])
    for fresh in (True, False):
        bufs = [mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                for _ in range(2)]
        if not fresh:
            for b in bufs:
                b.write(b"\0" * (1 << 20))
        jobs = [(OpCode.READ, memoryview(b), mapped, i << 20, 1 << 20) for i, b in enumerate(bufs)]
        assert d._run(jobs, time.monotonic() + 10) == [1 << 20, 1 << 20]  # type: ignore[arg-type]
        assert [bytes(b[:3]) for b in bufs] == [b"\0\1\2"] * 2
        assert split == [2]  # the fresh pass split its batch; the warm pass added nothing
