"""`profile_cache`: servers starting hold the profilers' lock shared, so a profile waits until
every sibling has loaded, and a server starting while a profile is measured waits for it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from yuebing.instance import profile_cache
from yuebing.protocol.instance import EngineProfile, Role

SIG = {"engine": "test", "machine": "m"}


def blocked_on(path: Path) -> bool:
    """Whether some lock request on ``path`` waits (a ``->`` line of /proc/locks)."""
    ino = os.stat(path).st_ino
    return any(line.split()[1] == "->" and line.split()[6].endswith(f":{ino}")
               for line in Path("/proc/locks").read_text().splitlines())


def wait_for(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_a_profile_waits_for_starting_servers_and_they_for_it(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    measuring, finish = threading.Event(), threading.Event()

    def measure() -> EngineProfile:
        measuring.set()
        assert finish.wait(10)
        return EngineProfile(configuration=SIG, prefill=[(1, 0, 0.1)], decode=[])

    def profile() -> None:
        profile_cache.cached_profile(SIG, Role.PREFILL, 1, measure, tmp_path)

    profiler = threading.Thread(target=profile)
    with profile_cache.starting(tmp_path), profile_cache.starting(tmp_path):  # side by side
        profiler.start()
        wait_for(lambda: blocked_on(lock))
        assert not measuring.is_set()  # not while the siblings load
    assert measuring.wait(10)
    started = threading.Event()

    def start() -> None:
        with profile_cache.starting(tmp_path):
            started.set()

    server = threading.Thread(target=start)
    server.start()
    wait_for(lambda: blocked_on(lock))
    assert not started.is_set()  # no loading while the profile is measured
    finish.set()
    profiler.join(10)
    server.join(10)
    assert started.is_set() and not profiler.is_alive()
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_starting_without_a_usable_directory_does_not_block(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with profile_cache.starting(blocker / "profiles"):  # under a file: cannot be made
        pass


def test_measuring_says_whether_a_profile_holds_the_lock(tmp_path: Path) -> None:
    assert not profile_cache.measuring(tmp_path / "none")  # no directory: nothing measures
    with profile_cache._cache_lock(tmp_path):
        assert profile_cache.measuring(tmp_path)
    assert not profile_cache.measuring(tmp_path)
    with profile_cache.starting(tmp_path):  # a server loading holds it shared: not a profile
        assert not profile_cache.measuring(tmp_path)
