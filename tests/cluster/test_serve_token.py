"""`yuebing serve` with a cluster token (``YUEBING_CLUSTER_TOKEN``): every role takes it from
its environment — the store master and the instances require it, the node, the instances'
store clients, the Conductor and the supervisor's readiness pings present it — so a request is
served end to end, while the token appears on no command line and a connection to the store
master without it is closed unanswered."""

from __future__ import annotations

import signal
import socket
import struct
from pathlib import Path

import pytest
from serve_util import Serve, cmdline, descendants, post

from yuebing.protocol import encode
from yuebing.protocol import store as m
from yuebing.store.wire import parse_address

pytestmark = pytest.mark.slow

TOKEN = "e2e-cluster-token-4f1c"
MODEL = "dummy:preset=tiny"


def test_serve_with_a_cluster_token(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = Serve(["serve", "--coupled", "1", "--model", MODEL, "--port", str(port),
                   "--log-dir", str(tmp_path), "--store-dram", "32MiB",
                   "--heartbeat-timeout-s", "30"], env={"YUEBING_CLUSTER_TOKEN": TOKEN})
    try:
        master = serve.wait_for("store master:").split("store master:", 1)[1].strip()
        serve.wait_for("Ctrl-C stops every process.")
        reply = post(f"http://127.0.0.1:{port}/v1/completions",
                     {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4})
        assert reply["usage"]["completion_tokens"] == 4
        pids = descendants(serve.proc.pid) | {serve.proc.pid}
        assert len(pids) >= 5 and not [p for p in pids if TOKEN in cmdline(p)]
        raw = socket.create_connection(parse_address(master), timeout=10)
        payload = encode(m.GetStats())
        raw.sendall(struct.pack("<IQ", len(payload), 1) + payload)
        assert raw.recv(12) == b""  # no token: closed before the frame is read
        raw.close()
    except BaseException:
        serve.kill()
        raise
    assert serve.stop(signal.SIGINT, timeout_s=120) == 0, serve.output()
