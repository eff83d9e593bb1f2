"""Child processes that say when they serve, started and stopped through their handle.

`ReadyProcess` starts a command with ``--ready-file F`` appended, waits for the JSON the process
writes there once it serves (``info``), and stops it (SIGTERM, then SIGKILL) or kills it through
its handle, never by name. A child that exits or is late is killed, and the error carries its
output's tail; one started from the main thread gets SIGTERM when its starter dies
(`die_with_parent`), so a killed benchmark leaves no cluster behind. Used by the benchmarks' process starters (`yuebing.store.benchprocs.Child`,
``benchmarks/conductor_overhead.py``) and the multi-process tests (``tests/cli_procs.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

KILL_WAIT_S = 10.0
"""How long a killed process is waited for."""
_PR_SET_PDEATHSIG = 1
_PRCTL: Any = None
"""libc's ``prctl``, resolved here in the parent: a child between fork and exec must not load
libraries (None: not Linux)."""
with contextlib.suppress(OSError, AttributeError):
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """For ``preexec_fn`` (in the child, between fork and exec; Linux): the kernel sends ``sig``
    when the *thread* that forked it exits, so spawn from a thread that lives as long as the
    child should (the main thread). A parent that died before this took effect ends the child
    at once (exit status 1). Elsewhere than Linux a no-op."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:  # no Python handler of the parent's may run here
        os._exit(1)


def yuebing_argv(args: Sequence[str], prefix: Sequence[str] = ()) -> list[str]:
    """The command line of ``yuebing <args>`` in this interpreter, after ``prefix`` (a command
    that execs the rest in place, e.g. ``ip netns exec NS``)."""
    return [*prefix, sys.executable, "-m", "yuebing.cli.main", *args]


class ReadyProcess:
    """One child process that writes a ready file (``argv`` + ``--ready-file F``).

    Output goes to ``<dir>/<name>.log`` (`log` returns its tail), or with ``pipe`` to
    ``proc.stdout`` for a caller that reads it itself (then `log` reads what is left once the
    process has exited). ``dir`` is ``workdir``, or a new temporary folder."""

    def __init__(self, argv: Sequence[str], *, name: str = "proc", workdir: Path | None = None,
                 timeout_s: float = 60.0, stop_s: float = 15.0, pipe: bool = False,
                 log_tail: int = 4000) -> None:
        self.name = name
        self.dir = workdir if workdir is not None else Path(
            tempfile.mkdtemp(prefix=f"yb-{name}-"))
        self.ready = self.dir / f"{name}.ready.json"
        self.log_path = self.dir / f"{name}.log"
        self.stop_s = stop_s
        self.log_tail = log_tail
        cmd = [*argv, "--ready-file", str(self.ready)]
        parent = os.getpid()
        setup = (None if threading.current_thread() is not threading.main_thread()
                 else lambda: die_with_parent(parent))
        if pipe:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env={**os.environ}, preexec_fn=setup)
        else:
            with self.log_path.open("wb") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             env={**os.environ}, preexec_fn=setup)
        try:
            self.info: dict[str, Any] = self._wait_ready(timeout_s)
        except BaseException:
            self.kill()  # never leave a process behind that did not get ready in time
            raise

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it "
                                   f"was ready:\n{self.log()}")
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name} not ready within {timeout_s}s:\n{self.log()}")
            time.sleep(0.05)
        info: dict[str, Any] = json.loads(self.ready.read_text())
        return info

    def log(self) -> str:
        """The tail of the process's output ("" while a piped process still runs: reading
        would block)."""
        if self.proc.stdout is not None:
            if self.proc.poll() is None:
                return ""
            return self.proc.stdout.read().decode(errors="replace")[-self.log_tail:]
        return self.log_path.read_text(errors="replace")[-self.log_tail:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(KILL_WAIT_S)

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM) without waiting; `stop` waits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it still runs after ``stop_s``."""
        self.terminate()
        try:
            self.proc.wait(self.stop_s)
        except subprocess.TimeoutExpired:
            self.kill()


def stop_all(procs: Iterable[ReadyProcess]) -> None:
    """Stop ``procs`` together: SIGTERM to each first (in the given order), then wait for each
    (its ``stop_s``) and SIGKILL those still running."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    for p in procs:
        p.stop()
