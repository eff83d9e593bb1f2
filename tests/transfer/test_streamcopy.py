"""`yuebing.transfer.streamcopy`: the C extension's streaming copy is built, copies exactly the
bytes asked (any alignment, any tail), refuses bad buffers, and the numpy fallback agrees."""

from __future__ import annotations

import shutil
import sysconfig
import time

import numpy as np
import pytest

from yuebing.transfer import streamcopy

LENGTHS = [0, 1, 15, 16, 17, 63, 64, 65, 127, 4096 + 3, (1 << 20) + 17]


@pytest.fixture(params=[True, False], ids=["streaming", "numpy"])
def mode(request):
    before = streamcopy.streaming()
    streamcopy.set_streaming(request.param)
    yield request.param
    streamcopy.set_streaming(before)


def test_extension_is_built_where_a_compiler_is():
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the numpy fallback is used")
    assert streamcopy.BUILT, "pip install did not build yuebing.transfer._streamcopy"


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 3), (7, 9), (15, 1)])
def test_copies_exactly_the_range(mode, n, dst_off, src_off):
    rng = np.random.default_rng(n + 31 * dst_off + src_off)
    src = rng.integers(0, 256, n + src_off + 64, dtype=np.uint8)
    dst = np.full(n + dst_off + 64, 0xAB, dtype=np.uint8)
    streamcopy.copy(dst[dst_off:dst_off + n], src[src_off:src_off + n])
    assert np.array_equal(dst[dst_off:dst_off + n], src[src_off:src_off + n])
    assert (dst[:dst_off] == 0xAB).all() and (dst[dst_off + n:] == 0xAB).all()


@pytest.mark.parametrize("shift", [-(4096 + 5), -1, 1, 33, 4096 + 5])
def test_overlapping_views_copy_like_memmove(mode, shift):
    n, at = (1 << 20) + 17, 8192
    buf = np.random.default_rng(abs(shift)).integers(0, 256, n + 2 * at, dtype=np.uint8)
    expect = buf.copy()
    expect[at + shift:at + shift + n] = buf[at:at + n].copy()
    streamcopy.copy(buf[at + shift:at + shift + n], buf[at:at + n])
    assert np.array_equal(buf, expect)


def test_native_copy_refuses_bad_buffers():
    if not streamcopy.BUILT:
        pytest.skip("extension not built")
    from yuebing.transfer import _streamcopy

    a, b = np.zeros(64, np.uint8), np.ones(65, np.uint8)
    with pytest.raises(ValueError, match="destination has 64 bytes, source 65"):
        _streamcopy.copy(a, b)
    with pytest.raises(TypeError):
        _streamcopy.copy(b"x" * 65, b)  # read-only destination
    with pytest.raises((TypeError, BufferError, ValueError)):
        _streamcopy.copy(np.zeros(64, np.uint8)[::2], np.zeros(32, np.uint8))  # strided
    with pytest.raises(TypeError):
        _streamcopy.copy(a)


def test_set_streaming_switches_and_off_is_numpy(monkeypatch):
    if not streamcopy.BUILT:
        pytest.skip("extension not built")
    before = streamcopy.streaming()
    try:
        calls = []
        monkeypatch.setattr(streamcopy, "_native", type("N", (), {"copy": staticmethod(
            lambda d, s: calls.append(len(d)))}))
        streamcopy.set_streaming(True)
        streamcopy.copy(np.zeros(8, np.uint8), np.ones(8, np.uint8))
        streamcopy.set_streaming(False)
        dst = np.zeros(8, np.uint8)
        streamcopy.copy(dst, np.ones(8, np.uint8))
        assert calls == [8] and (dst == 1).all() and not streamcopy.streaming()
    finally:
        streamcopy.set_streaming(before)


def test_the_small_copy_limits_are_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    if not streamcopy.BUILT:
        pytest.skip("no streaming stores: the limit is the fixed default")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(streamcopy, "_streaming", True)
    monkeypatch.setattr(streamcopy, "_small", None)
    write, read = streamcopy.small_copy(), streamcopy.small_copy(read=True)
    assert write in streamcopy.SMALL_CANDIDATES and read in streamcopy.SMALL_CANDIDATES
    assert len(list((tmp_path / "yuebing" / "choices").glob("*.json"))) == 1

    def never():  # type: ignore[no-untyped-def]
        raise AssertionError("measured again though this machine's limits are kept")

    monkeypatch.setattr(streamcopy, "_small", None)  # a later process reads the kept limits
    monkeypatch.setattr(streamcopy, "measure_small_copy", never)
    assert (streamcopy.small_copy(), streamcopy.small_copy(read=True)) == (write, read)
    monkeypatch.setattr(streamcopy, "_streaming", False)
    assert streamcopy.small_copy() == streamcopy.small_copy(read=True) == streamcopy.SMALL_DEFAULT


def test_the_limits_are_timed_at_every_candidate_and_are_candidates():
    write, read, timings = streamcopy.measure_small_copy(reps=3, arena=8 << 20)
    for limit, times in ((write, timings["write"]), (read, timings["read"])):
        assert [int(k) for k in times] == list(streamcopy.SMALL_CANDIDATES)
        assert all(len(t) == 2 and min(t) > 0 for t in times.values())
        assert limit == streamcopy.least_cost_limit(times)


def _times(plain_over_streamed: list[float]) -> dict[str, list[float]]:
    """Timings where the assignment costs the given multiple of streaming per candidate."""
    return {str(n): [r * n / 1000, n / 1000]
            for n, r in zip(streamcopy.SMALL_CANDIDATES, plain_over_streamed, strict=True)}


def test_the_limit_is_the_least_cost_cut_not_the_first_crossing():
    c = streamcopy.SMALL_CANDIDATES
    # one noisy crossing at the second size must not stop the search: memcpy wins above it
    assert streamcopy.least_cost_limit(_times([0.8, 1.1, 0.7, 0.8, 0.9, 1.2])) == c[4]
    assert streamcopy.least_cost_limit(_times([1.5, 1.5, 1.5, 1.5, 1.5, 1.5])) == c[0]
    assert streamcopy.least_cost_limit(_times([0.5, 0.5, 0.5, 0.5, 0.5, 0.5])) == c[-1]
    assert streamcopy.least_cost_limit(_times([0.5, 0.9, 1.3, 1.4, 1.6, 1.6])) == c[1]
    # per byte, each size counts alike (in µs the 2 MiB copy alone would move the cut to c[5])
    assert streamcopy.least_cost_limit(_times([0.1, 0.1, 0.1, 0.1, 1.1, 0.91])) == c[3]


@pytest.mark.parametrize("raw", [[0, 65536, {}], ["65536", 65536, {}], [65536, 65536, []],
                                 [65536, {}], [65536, 1 << 31, {}],
                                 [65536, 65536, {"write": 1}]])
def test_a_malformed_kept_limit_is_refused(raw):
    with pytest.raises((TypeError, ValueError)):
        streamcopy.small_choice(raw)


def test_the_timings_put_the_assignment_first_and_warm_each_kind_up(monkeypatch):
    calls = []

    def slow(dst, src):  # type: ignore[no-untyped-def]
        calls.append(src.nbytes)
        time.sleep(0.002)  # makes the fake streaming copy slower than any 2 MiB memcpy
        np.copyto(dst, src)

    monkeypatch.setattr(streamcopy, "copy", slow)
    reps = 2
    write, read, timings = streamcopy.measure_small_copy(reps=reps, arena=8 << 20)
    n = len(streamcopy.SMALL_CANDIDATES)
    assert len(calls) == 2 * 2 * reps * n  # writes and reads: an untimed copy before each timed
    for times in timings.values():
        assert all(t[1] > t[0] for t in times.values())  # [assignment, streaming]
    assert write == read == streamcopy.SMALL_CANDIDATES[-1]
