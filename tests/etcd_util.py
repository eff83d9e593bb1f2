"""Start and stop a real etcd server on free loopback ports for tests.

Reusable by every package's tests (transfer-engine discovery, store master HA)::

    from etcd_util import EtcdServer, etcd_server  # noqa: F401  (tests/ is on sys.path)

    def test_discovery(etcd_server):          # module-scoped fixture below
        url = etcd_server.url                 # "http://127.0.0.1:<client port>"

    with EtcdServer() as etcd:                # or by hand, e.g. to kill/restart it mid-test
        ...
        etcd.stop()

The server is Debian's ``etcd-server`` (3.4; ``scripts/install_test_servers.sh`` installs it).
It binds 127.0.0.1 (or the ``host`` it is given, started through ``prefix``), keeps its data
in a fresh temporary directory that is removed on stop, and is started with a short election
timeout so it is ready in well under a second.
Tests that need it are skipped (not failed) when the ``etcd`` binary is missing; mark them
``@pytest.mark.etcd``. Only the process this helper started is ever signalled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from yuebing.ops import ports

ETCD_BINARY_ENV = "YUEBING_ETCD_BIN"
"""Environment variable naming an etcd binary to use instead of the one on ``PATH``."""


def find_etcd() -> str | None:
    """Path of the etcd binary (``$YUEBING_ETCD_BIN`` or ``etcd`` on PATH), or None."""
    return os.environ.get(ETCD_BINARY_ENV) or shutil.which("etcd")


def free_port() -> int:
    """A port on 127.0.0.1 outside the ephemeral range, free a moment ago (`yuebing.ops.ports`)."""
    return ports.free_port("127.0.0.1")


class EtcdServer:
    """One single-member etcd cluster on 127.0.0.1 with its data in a temporary directory.

    ``url`` is the client URL (``http://127.0.0.1:PORT``), ``host``/``port`` its parts.
    `start` blocks until ``/health`` answers (or raises RuntimeError with the log tail);
    `stop` terminates the process (SIGTERM, then SIGKILL) and removes the data directory.
    `kill` is ``kill -9`` that keeps the data directory: a later `start` restarts the same
    member at the same address with the data it had (as an operator would).
    """

    def __init__(self, binary: str | None = None, name: str = "yuebing-test", *,
                 host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        found = binary or find_etcd()
        if found is None:
            raise FileNotFoundError(
                "etcd binary not found; run scripts/install_test_servers.sh (Debian etcd-server)")
        self.binary = found
        self.name = name
        self.host = host
        self.prefix = prefix
        """A command that execs the rest in place (``ip netns exec NS``: etcd on a test host
        of ``tests/faults/netns.py``, binding ``host``, that host's address)."""
        self.port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        if self._dir is None:  # else a restart after `kill`: same data, same ports
            self._dir = Path(tempfile.mkdtemp(prefix="yuebing-etcd-"))
            self.port, self.peer_port = free_port(), free_port()
        peer_url = f"http://{self.host}:{self.peer_port}"
        cmd = [
            *self.prefix, self.binary, "--name", self.name, "--data-dir", str(self._dir / "data"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}", "--initial-cluster-state", "new",
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--log-level", "warn", "--logger", "zap",
        ]
        log = open(self._dir / "etcd.log", "ab")  # noqa: SIM115 - handed to the child
        env = dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", ""))
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self._healthy():
                return self
            time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout_s}s; log:\n{tail}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False

    def log_tail(self, n: int = 4000) -> str:
        if self._dir is None or not (self._dir / "etcd.log").exists():
            return ""
        return (self._dir / "etcd.log").read_bytes()[-n:].decode(errors="replace")

    def kill(self, lose_data: bool = False) -> None:
        """``kill -9`` the server; its ports stay for `start`, and its data unless
        ``lose_data`` (then `start` brings up an empty member at the same address)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5)
            self.proc = None
        if lose_data and self._dir is not None:
            shutil.rmtree(self._dir / "data", ignore_errors=True)

    def stop(self) -> None:
        """Stop the server this object started (idempotent) and delete its data."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
            self.proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    """A running etcd for the test module (skips the tests if etcd is not installed)."""
    if find_etcd() is None:
        pytest.skip("etcd not installed (scripts/install_test_servers.sh)")
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()
