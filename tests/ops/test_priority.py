"""`ops.priority`: an engine process lowers every thread it has and, leading its session, its
autogroup; a child lowered between fork and exec passes it on to what it starts; a process that
shares its session leaves the session's autogroup alone; bad values are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from yuebing.ops.priority import EnginePriority

REPORT = """
import json, os, subprocess, sys, threading
def state(pid):
    tids = os.listdir(f"/proc/{pid}/task")
    return {"nice": sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in tids}),
            "idle": sorted({os.sched_getscheduler(int(t)) == os.SCHED_IDLE for t in tids}),
            "group": (open(f"/proc/{pid}/autogroup").read().split() or ["root"])[-1]}
"""
SELF = REPORT + """
gate = threading.Event()
t = threading.Thread(target=gate.wait); t.start()  # a thread older than the change
from yuebing.ops.priority import EnginePriority
done = EnginePriority(nice=3, idle=len(sys.argv) > 1).apply_self()
kid = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                     capture_output=True, text=True).stdout.strip()
out = state(os.getpid()); gate.set(); t.join()
print(json.dumps({**out, "done": done, "kid": int(kid)}))
"""
CHILD = REPORT + "print(json.dumps(state(os.getpid())))"
AUTOGROUPS = Path("/proc/self/autogroup").exists()


def run(code: str, *args: str, **popen: object) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env=env, timeout=60, check=True, **popen)  # type: ignore[call-overload]
    return json.loads(out.stdout)


def expected(add: int) -> int:
    return min(19, os.getpriority(os.PRIO_PROCESS, 0) + add)


@pytest.mark.skipif(not AUTOGROUPS, reason="kernel without autogroups")
def test_a_session_leader_lowers_its_threads_children_and_autogroup() -> None:
    out = run(SELF, start_new_session=True)
    assert out["nice"] == [expected(3)] and out["kid"] == expected(3)
    assert out["idle"] == [False]
    assert out["group"] == "3" and "autogroup nice 3" in out["done"]  # a new session's: 0 + 3
    idle = run(SELF, "idle", start_new_session=True)
    assert idle["idle"] == [True] and idle["group"] == "3"


@pytest.mark.skipif(not AUTOGROUPS, reason="kernel without autogroups")
def test_a_process_in_its_parents_session_leaves_the_autogroup_alone() -> None:
    mine = (Path("/proc/self/autogroup").read_text().split() or ["root"])[-1]  # empty in CI
    out = run(SELF)
    assert out["group"] == mine and "left as it is" in out["done"]
    assert out["nice"] == [expected(3)]


@pytest.mark.skipif(not AUTOGROUPS, reason="kernel without autogroups")
def test_a_child_is_lowered_before_its_exec() -> None:
    prio = EnginePriority(nice=5, idle=True)
    out = run(CHILD, start_new_session=True, preexec_fn=prio.apply_child)
    assert out == {"nice": [expected(5)], "idle": [True], "group": "5"}
    off = run(CHILD, start_new_session=True, preexec_fn=EnginePriority(nice=0).apply_child)
    assert off == {"nice": [expected(0)], "idle": [False], "group": "0"}


def test_bad_values_are_refused() -> None:
    for bad in (-5, 20):
        with pytest.raises(ValueError, match=rf"--engine-nice must be in 0..19 .*got {bad}"):
            EnginePriority(nice=bad)
    assert EnginePriority(nice=0).off and not EnginePriority(nice=0, idle=True).off
