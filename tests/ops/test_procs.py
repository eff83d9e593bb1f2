"""`yuebing.ops.procs.ReadyProcess`: a child started from the main thread ends when its starter
is killed (a killed benchmark leaves no cluster behind); one started from another thread does
not get that signal (the thread's exit would fire it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CHILD = textwrap.dedent("""
    import json, os, sys, time
    ready = sys.argv[sys.argv.index("--ready-file") + 1]
    with open(ready + ".tmp", "w") as f:
        json.dump({"pid": os.getpid()}, f)
    os.rename(ready + ".tmp", ready)
    time.sleep(120)
""")

STARTER = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    from yuebing.ops.procs import ReadyProcess
    out, child, where = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    def start():
        p = ReadyProcess([sys.executable, "-c", child], name="child", workdir=out.parent)
        out.write_text(json.dumps(p.info))
    if where == "main":
        start()
    else:
        t = threading.Thread(target=start)
        t.start()
        t.join()  # the thread that forked the child has ended
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(tmp_path: Path, where: str) -> tuple[subprocess.Popen[bytes], int]:
    out = tmp_path / "info.json"
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(out), CHILD, where])
    end = time.monotonic() + 30
    while not out.exists():
        assert starter.poll() is None, "the starter exited early"
        assert time.monotonic() < end, "the child never got ready"
        time.sleep(0.05)
    return starter, int(json.loads(out.read_text())["pid"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_ends_when_its_starter_is_killed(tmp_path: Path) -> None:
    starter, child = _start(tmp_path, "main")
    try:
        assert _alive(child)
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        end = time.monotonic() + 10
        while _alive(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its killed starter"
    finally:
        starter.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_started_from_another_thread_outlives_that_thread(tmp_path: Path) -> None:
    starter, child = _start(tmp_path, "thread")
    try:
        time.sleep(0.5)  # the forking thread has ended: a parent-death signal would have fired
        assert _alive(child)
    finally:
        starter.kill()
        starter.wait(10)
        if _alive(child):
            os.kill(child, signal.SIGKILL)
