"""`yuebing.ops.shm`: the files a killed process group held are swept, those another living
process holds are kept, and files the group never held are never candidates; a named semaphore
of multiprocessing's spawn context (vLLM's on CPU), which its creator maps under a temporary
name, counts as held by the creator's group and is swept once the group is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from yuebing.ops.pgroup import group_alive
from yuebing.ops.shm import group_files, sweep

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")

HOLDER = textwrap.dedent("""
    import mmap, os, sys, time
    for path in sys.argv[1:]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)
        globals().setdefault("maps", []).append(mmap.mmap(fd, 4096))
        os.close(fd)
    print("ready", flush=True)
    time.sleep(120)
""")


def _hold(*paths: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, paths)], text=True,
                         stdout=subprocess.PIPE, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_killed_groups_files_are_swept_and_held_ones_kept(tmp_path: Path) -> None:
    mine, shared, other = (tmp_path / f"psm_{n}" for n in ("mine", "shared", "other"))
    other.write_bytes(b"x")  # never held by the group: not a candidate
    group = _hold(mine, shared)
    keeper = _hold(shared)
    try:
        held = group_files(group.pid, tmp_path)
        assert held.keys() == {mine, shared}
        os.killpg(group.pid, signal.SIGKILL)
        group.wait(10)
        end = time.monotonic() + 5
        while group_alive(group.pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert not group_alive(group.pid)
        assert sweep(held) == [mine]
        assert not mine.exists() and shared.exists() and other.exists()
    finally:
        for p in (group, keeper):
            _reap(p)


def test_only_files_with_the_prefix_count(tmp_path: Path) -> None:
    psm, sem, ours = tmp_path / "psm_a", tmp_path / "sem.mp-b", tmp_path / "yuebing-seg"
    group = _hold(psm, sem, ours)
    try:
        held = group_files(group.pid, tmp_path)
        assert held.keys() == {psm, sem} and held[psm] == psm.stat().st_ino
        assert sweep({psm: held[psm]}) == []  # still held
    finally:
        _reap(group)


SEMAPHORE = textwrap.dedent("""
    import multiprocessing, time
    lock = multiprocessing.get_context("spawn").Lock()  # its name stays until the tracker ends
    print(lock._semlock.name, flush=True)
    time.sleep(120)
""")


def test_a_killed_groups_spawn_semaphore_is_found_and_swept() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    # its own session: the group holds it and multiprocessing's resource tracker
    group = subprocess.Popen([sys.executable, "-c", SEMAPHORE], text=True,
                             stdout=subprocess.PIPE, start_new_session=True)
    sem = Path("/")
    try:
        assert group.stdout is not None
        sem = shm / ("sem." + group.stdout.readline().strip().lstrip("/"))
        assert sem.name.startswith("sem.mp-") and sem.exists()
        held = group_files(group.pid)
        assert held.keys() == {sem}  # mapped by its creator as /dev/shm/sem.XXXXXX (deleted)
        assert sweep(held) == []  # still held
        os.killpg(group.pid, signal.SIGKILL)  # its resource tracker too: nobody unlinks it
        group.wait(10)
        end = time.monotonic() + 10
        while group_alive(group.pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert sem.exists()
        assert sweep(held) == [sem]
        assert not sem.exists()
    finally:
        _reap(group)
        if sem.name.startswith("sem.mp-"):
            sem.unlink(missing_ok=True)


def _reap(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(10)


def test_a_name_reused_since_it_was_seen_held_is_not_swept(tmp_path: Path) -> None:
    """`group_files` notes each file's inode; a file that took the name afterwards (another
    program's) is not the one the group held, so `sweep` leaves it."""
    f = tmp_path / "psm_x"
    f.write_bytes(b"old")
    seen = {f: f.stat().st_ino}
    os.link(f, tmp_path / "keep")  # the old inode stays allocated: the new file gets another
    f.unlink()
    f.write_bytes(b"new")
    assert sweep(seen) == [] and f.read_bytes() == b"new"
    assert sweep([f]) == [f] and not f.exists()  # by path alone: whatever it names now
