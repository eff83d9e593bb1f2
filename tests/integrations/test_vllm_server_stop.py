"""`VllmServer.stop` leaves nothing of the server's process group behind, also when the API
server itself was killed first (its engine-core and worker processes outlive it), without a
real vLLM: a shell stands in, with a child in its group."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from yuebing.integrations.vllm.server import VllmServer, VllmServerConfig


class _ShellConfig(VllmServerConfig):
    def argv(self, env: object) -> list[str]:  # type: ignore[override]
        # the "engine core": a child in the same process group, writing its pid
        return ["bash", "-c", f"sleep 300 & echo $! > {self.extra[0][1]}; wait"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def _child(path: Path) -> int:
    end = time.monotonic() + 10
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < end
        time.sleep(0.02)
    return int(path.read_text())


def test_stop_kills_the_group_even_after_the_server_died(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    server = VllmServer(_ShellConfig(port=1, extra=(("pidfile", str(pidfile)),)),
                        tmp_path / "vllm.log")
    child = _child(pidfile)
    os.kill(server.proc.pid, signal.SIGKILL)  # the API server dies, its child lives on
    server.proc.wait(10)
    assert _alive(child)
    server.stop(timeout_s=1)
    end = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < end, "the server's child outlived stop()"
        time.sleep(0.02)


def test_stop_ends_a_running_server_and_its_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    server = VllmServer(_ShellConfig(port=1, extra=(("pidfile", str(pidfile)),)),
                        tmp_path / "vllm.log")
    child = _child(pidfile)
    server.stop(timeout_s=5)
    assert server.proc.returncode is not None
    end = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < end, "the server's child outlived stop()"
        time.sleep(0.02)
