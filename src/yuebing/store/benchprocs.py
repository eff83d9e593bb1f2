"""Start a master and a storage node as child processes of the store benchmark (loopback only);
each is stopped through the handle that started it."""

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


class Child:
    """A ``yuebing`` CLI child process; ``info`` is the JSON it wrote to its ready file."""

    def __init__(self, args: list[str], timeout_s: float = 60.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="yb-store-bench-"))
        ready = self.dir / "ready.json"
        self.log = open(self.dir / "log.txt", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "yuebing.cli.main", *args,
                                      "--ready-file", str(ready)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        end = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"{args[:2]} did not start: "
                                   f"{(self.dir / 'log.txt').read_text()[-2000:]}")
            time.sleep(0.05)
        self.info: dict[str, Any] = json.loads(ready.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def start_master(*extra: str) -> Child:
    return Child(["store", "master", "--rpc-address", "tcp://127.0.0.1:0", *extra])


def start_node(master: str, dram: str, *extra: str) -> Child:
    return Child(["store", "node", "--master", master, "--dram", dram, "--name", "bench-node",
                  *extra])
