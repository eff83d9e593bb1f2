"""Fixtures of the transfer-engine tests: peer processes and small engines."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from yuebing.transfer import TransferConfig, TransferEngine

PEER = Path(__file__).with_name("peer_proc.py")


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

    def stop(self) -> None:
        if self.proc.poll() is None:
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
