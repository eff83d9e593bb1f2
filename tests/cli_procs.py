"""Real ``yuebing`` CLI processes for multi-process tests, on 127.0.0.1.

`CliProc` starts ``python -m yuebing.cli.main <args> --ready-file F``, waits until the process
has written the JSON it writes to ``F`` once it serves (``info``), and stops it (SIGTERM, then
SIGKILL after ``stop_s``) or kills it through the handle that started it — never by name. A
process that exits or is not ready in time is killed and its output's tail is in the error.
The store's, the instances' and the Conductor's helpers (``tests/store/store_procs.py``,
``tests/instance/instance_procs.py``, ``tests/conductor/procs.py``) build on it; ``tests/`` is on
``sys.path`` (pytest inserts its conftest's directory), so any test imports it as ``cli_procs``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class CliProc:
    """One ``yuebing`` CLI process that writes a ready file.

    Output goes to ``<dir>/<name>.log`` (`log` returns its tail), or with ``pipe`` to
    ``proc.stdout`` for a test that reads it itself (then `log` reads what is left once the
    process has exited). ``prefix`` is a command that execs the rest in place (so ``proc.pid``
    is still the yuebing process), e.g. ``ip netns exec NS`` to start it in a network
    namespace."""

    def __init__(self, args: list[str], *, name: str = "proc", workdir: Path | None = None,
                 timeout_s: float = 60.0, stop_s: float = 15.0, pipe: bool = False,
                 log_tail: int = 4000, prefix: tuple[str, ...] = ()) -> None:
        self.name = name
        self.dir = workdir if workdir is not None else Path(
            tempfile.mkdtemp(prefix=f"yb-test-{name}-"))
        self.ready = self.dir / f"{name}.ready.json"
        self.log_path = self.dir / f"{name}.log"
        self.stop_s = stop_s
        self.log_tail = log_tail
        cmd = [*prefix, sys.executable, "-m", "yuebing.cli.main", *args,
               "--ready-file", str(self.ready)]
        if pipe:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env={**os.environ})
        else:
            with self.log_path.open("wb") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                             env={**os.environ})
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
        return json.loads(self.ready.read_text())  # type: ignore[no-any-return]

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
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.kill()
