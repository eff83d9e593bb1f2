"""`yuebing.ops.pgroup`: a process group's members, liveness (a zombie does not run) and CPU time,
on a fake ``/proc`` (exact values) and on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from yuebing.ops.pgroup import (
    ProcStat,
    group_alive,
    group_cpu_seconds,
    group_pids,
    kill_group,
    proc_stat,
)

REAL = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
REAL_PID_MAX = Path("/proc/sys/kernel/pid_max").exists()


def _stat(root: Path, pid: int, pgid: int, utime: int, stime: int, state: str = "S",
          name: str = "py") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    (d / "stat").write_text(f"{pid} ({name}) {state} 1 {pgid} 1 0 -1 0 0 0 0 0 {utime} {stime} 0")


def test_a_group_on_a_fake_proc(tmp_path: Path) -> None:
    _stat(tmp_path, 10, 10, 100, 50)
    _stat(tmp_path, 11, 10, 30, 20, name="odd) name (x")  # a ")" in the name
    _stat(tmp_path, 12, 10, 5, 5, state="Z")  # exited, not reaped
    _stat(tmp_path, 20, 20, 999, 999)  # another group
    _stat(tmp_path, 30, 30, 1, 1, state="Z")  # a group left with only a zombie
    (tmp_path / "self").mkdir()  # not a pid
    hz = os.sysconf("SC_CLK_TCK")
    assert group_pids(10, tmp_path) == [10, 11, 12]
    assert group_cpu_seconds(10, tmp_path) == pytest.approx(210 / hz)
    assert group_alive(10, tmp_path) and group_alive(20, tmp_path)
    assert not group_alive(30, tmp_path) and group_pids(30, tmp_path) == [30]
    assert not group_alive(40, tmp_path) and group_cpu_seconds(40, tmp_path) == 0.0
    assert proc_stat(11, tmp_path) == ProcStat("S", 10, 50)
    assert proc_stat(99, tmp_path) is None  # gone
    assert group_pids(10, tmp_path / "missing") == []


def test_a_malformed_stat_line_is_refused() -> None:
    with pytest.raises(ValueError, match="not a /proc/<pid>/stat line"):
        ProcStat.parse(b"12 (py) S 1")
    with pytest.raises(ValueError, match="not a /proc/<pid>/stat line"):
        ProcStat.parse(b"no name here")


@REAL
def test_an_exited_unreaped_leader_is_listed_but_not_alive() -> None:
    """Signal 0 to the group still succeeds for a zombie; `group_alive` says it runs no more."""
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        end = time.monotonic() + 30
        while (st := proc_stat(p.pid)) is not None and st.state != "Z":
            assert time.monotonic() < end, st
            time.sleep(0.02)
        assert group_pids(p.pid) == [p.pid]
        os.killpg(p.pid, 0)  # what a signal-0 test would take for "alive"
        assert not group_alive(p.pid)
    finally:
        p.wait(10)
    assert group_pids(p.pid) == [] and proc_stat(p.pid) is None


@REAL
def test_a_running_group_uses_cpu_and_is_alive() -> None:
    spin = "import time\nt = time.process_time() + 0.3\nwhile time.process_time() < t: pass\n" \
           "print('done', flush=True)\ntime.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True, text=True,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "done"
        assert group_alive(p.pid) and group_pids(p.pid) == [p.pid]
        assert group_cpu_seconds(p.pid) >= 0.3 - 2 / os.sysconf("SC_CLK_TCK")
    finally:
        p.kill()
        p.wait(10)
    assert not group_alive(p.pid)


@REAL
def test_kill_group_returns_once_no_process_of_the_group_runs() -> None:
    """A leader and a busy child it forked: when `kill_group` returns True neither runs (the
    leader, not reaped yet, is a zombie), however late the scheduler lets them exit."""
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
            "print('up', flush=True)\ntime.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, text=True,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        assert len(group_pids(p.pid)) == 2 and group_alive(p.pid)
        assert kill_group(p.pid, wait_s=30)
        assert not group_alive(p.pid)
    finally:
        kill_group(p.pid, wait_s=10)  # the spinning child too, if an assertion failed first
        p.kill()
        p.wait(10)
    assert kill_group(p.pid)  # a group already gone is gone at once


def test_kill_group_waits_out_its_time_for_a_process_that_still_runs(tmp_path: Path) -> None:
    """On a fake ``/proc`` (a group id above the kernel's pid_max: nothing real is signalled),
    a member that keeps running is waited for ``wait_s`` and named; a zombie counts as gone;
    a group's id of 0 or 1 (the caller's own group, init) is refused."""
    pgid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1000 if REAL_PID_MAX else 10**7
    _stat(tmp_path, pgid, pgid, 1, 1, state="R")
    t0 = time.monotonic()
    assert not kill_group(pgid, wait_s=0.3, proc_dir=tmp_path)
    assert time.monotonic() - t0 >= 0.3
    (tmp_path / str(pgid) / "stat").unlink()
    (tmp_path / str(pgid)).rmdir()
    _stat(tmp_path, pgid, pgid, 1, 1, state="Z")
    assert kill_group(pgid, wait_s=0.3, proc_dir=tmp_path)
    for bad in (0, 1, -5):
        with pytest.raises(ValueError, match="not a child's group"):
            kill_group(bad, proc_dir=tmp_path)
