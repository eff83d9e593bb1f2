"""Fixtures of the transfer-engine tests: peer processes and small engines."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from yuebing.transfer import TransferConfig, TransferEngine

PEER = Path(__file__).with_name("peer_proc.py")


def _state(pid: int) -> str:
    """A process's scheduler state letter from ``/proc/PID/stat`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


class Peer:
    """A running ``peer_proc.py``: ``name`` is how other engines address its segment."""

    def __init__(self, size: int, metadata: str, name: str = "peer", hammer: str = "") -> None:
        args = [sys.executable, str(PEER), str(size), metadata, name] + ([hammer] if hammer else [])
        self.proc = subprocess.Popen(args,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.name = self.proc.stdout.readline().strip()
        if not self.name:
            raise RuntimeError(f"peer process exited with {self.proc.wait()}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def freeze(self) -> None:
        """SIGSTOP: the process stays connected but answers nothing until killed or thawed.
        Returns once the kernel shows it stopped (the signal is delivered asynchronously)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(self.proc.pid) != "T":
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer {self.proc.pid} did not stop after SIGSTOP")
            time.sleep(0.001)

    def thaw(self) -> None:
        """SIGCONT: a frozen process runs on (and answers what arrived meanwhile)."""
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.thaw()  # a test that failed while it was frozen
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., Peer]]:
    """``spawn_peer(size, metadata="p2p", name="peer", hammer="")`` starts a peer process (that
    keeps writing to segment ``hammer`` if given); all are stopped at the end of the test."""
    peers: list[Peer] = []

    def spawn(size: int, metadata: str = "p2p", name: str = "peer", hammer: str = "") -> Peer:
        peers.append(Peer(size, metadata, name, hammer))
        return peers[-1]

    yield spawn
    for p in peers:
        p.stop()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., TransferEngine]]:
    """``make_engine(**config)`` builds engines that are closed at the end of the test."""
    engines: list[TransferEngine] = []

    def make(**kw: object) -> TransferEngine:
        engines.append(TransferEngine(TransferConfig(**kw)))  # type: ignore[arg-type]
        return engines[-1]

    yield make
    for e in engines:
        e.close()


OWNER = Path(__file__).with_name("owner_proc.py")


class Owner:
    """A running ``owner_proc.py``: ``name`` is how peers address its segment, ``path`` the
    segment's file; `cmd` sends one command line and returns the answer line."""

    def __init__(self, size: int, metadata: str, name: str, shm_dir: str, port: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(OWNER), str(size), metadata, name, shm_dir, str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.cmd(None).split()
        if len(ready) != 3 or ready[0] != "ready":
            raise RuntimeError(f"owner process said {ready!r}, exited {self.proc.poll()}")
        self.name, self.path = ready[1], ready[2]
        self.children: list[int] = []

    def cmd(self, line: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def fork_socket_keeper(self) -> int:
        """A child that keeps this owner's sockets open after it dies (`owner_proc`)."""
        pid = int(self.cmd("fork").split()[1])
        self.children.append(pid)
        return pid

    def kill(self) -> None:
        """SIGKILL: no cleanup, the segment file stays."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # not our child (the owner's): reaped by init
        self.children = []


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory under /dev/shm for segment files (sweeps there touch nothing else)."""
    path = tempfile.mkdtemp(prefix="yb-test-shm-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def spawn_owner(shm_dir: str) -> Iterator[Callable[..., Owner]]:
    """``spawn_owner(size, metadata="p2p", name="kv", port=0)`` starts an owner process with
    its segment files in ``shm_dir``; all are stopped at the end of the test."""
    owners: list[Owner] = []

    def spawn(size: int, metadata: str = "p2p", name: str = "kv", port: int = 0) -> Owner:
        owners.append(Owner(size, metadata, name, shm_dir, port))
        return owners[-1]

    yield spawn
    for o in owners:
        o.stop()
