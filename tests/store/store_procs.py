"""Test helpers: real master and node processes on 127.0.0.1 (started via the CLI), stopped by
the pid this helper started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _wait_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> dict:
    """The JSON a starting process wrote to its ready file (60 s: a loaded 2-core VM can take
    tens of seconds to start a Python process)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}: "
                               f"{proc.stdout.read().decode() if proc.stdout else ''}")
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not appear within {timeout_s}s")


class Proc:
    """A yuebing CLI process; ``info`` is what it wrote to its ready file."""

    def __init__(self, args: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="yb-store-test-"))
        ready = self.dir / "ready.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yuebing.cli.main", *args, "--ready-file", str(ready)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            self.info = _wait_file(ready, self.proc)
        except BaseException:
            self.kill()  # never leave a process behind that did not get ready in time
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def master(*extra: str) -> Proc:
    return Proc(["store", "master", "--rpc-address", "tcp://127.0.0.1:0", "--tick-s", "0.05",
                 *extra])


def node(master_addr: str, dram: str = "16MiB", *extra: str) -> Proc:
    return Proc(["store", "node", "--master", master_addr, "--dram", dram, "--heartbeat-s",
                 "0.2", *extra])
