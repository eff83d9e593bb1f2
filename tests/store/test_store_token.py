"""The store RPC's cluster token: a master with a token serves only connections that open with
its preamble (`wire.auth_preamble`); others are closed before any frame is parsed. Non-loopback
binds without a token are a start-up error."""

from __future__ import annotations

import contextlib
import socket
import struct

import pytest
from store_procs import store_cluster

from yuebing.core.errors import ConfigError, StoreError
from yuebing.protocol import encode
from yuebing.protocol import store as m
from yuebing.store.client.rpc import MasterConnection
from yuebing.store.config import MasterConfig, NodeConfig
from yuebing.store.wire import AUTH_LEN, FrameSocket, auth_preamble, parse_address
from yuebing.store.wire_limits import FrameLimits
from yuebing.store.wire_server import FrameServer

TOKEN = "s3cret-token"


def _echo(token: str, frame_timeout_s: float = 0.0) -> FrameServer:
    srv: FrameServer

    def on_frame(cid: int, rid: int, payload: bytes) -> None:
        srv.send(cid, rid, payload[::-1])

    srv = FrameServer("tcp://127.0.0.1:0", on_frame, limits=FrameLimits(
        frame_timeout_s=frame_timeout_s), token=token)
    return srv


def _serve_until(srv: FrameServer, done: object, rounds: int = 200) -> None:
    for _ in range(rounds):
        srv.poll(0.01)
        if done():  # type: ignore[operator]
            return


def test_preamble_accepted_in_pieces_and_frames_follow_in_the_same_read() -> None:
    srv = _echo(TOKEN)
    s = socket.create_connection(parse_address(srv.address), timeout=2)
    try:
        pre = auth_preamble(TOKEN)
        assert len(pre) == AUTH_LEN
        s.sendall(pre[:3])
        _serve_until(srv, lambda: bool(srv.conns))
        s.sendall(pre[3:] + struct.pack("<IQ", 3, 9) + b"abc")  # rest + a frame, one write
        s.settimeout(0.05)
        got = b""
        while len(got) < 15:
            _serve_until(srv, lambda: True, 5)
            with contextlib.suppress(TimeoutError):
                got += s.recv(64)
        assert got == struct.pack("<IQ", 3, 9) + b"cba" and srv.refused_auth == 0
    finally:
        s.close()
        srv.close()


@pytest.mark.parametrize("first", [
    struct.pack("<IQ", 3, 1) + b"abc",  # a client without the token sends a frame at once
    auth_preamble("wrong"),  # a client with another cluster's token
])
def test_connection_without_the_right_token_is_closed_unanswered(first: bytes) -> None:
    srv = _echo(TOKEN)
    s = socket.create_connection(parse_address(srv.address), timeout=2)
    try:
        s.sendall(first)
        _serve_until(srv, lambda: srv.refused_auth == 1)
        assert srv.refused_auth == 1 and not srv.conns and srv.buffered == 0
        assert s.recv(64) == b""  # closed, no reply
        ok = FrameSocket(srv.address, 2.0, token=TOKEN)  # the server keeps serving
        ok.send(5, b"xy")
        reply = None
        for _ in range(200):
            srv.poll(0.01)
            reply = ok.recv(0.01)
            if reply is not None:
                break
        assert reply == (5, b"yx")
        ok.close()
    finally:
        s.close()
        srv.close()


def test_silent_connection_closed_at_the_frame_deadline() -> None:
    srv = _echo(TOKEN, frame_timeout_s=0.2)
    s = socket.create_connection(parse_address(srv.address), timeout=2)
    try:
        s.sendall(auth_preamble(TOKEN)[:10])
        _serve_until(srv, lambda: srv.refused_auth == 1, 300)
        assert srv.refused_auth == 1 and not srv.conns
    finally:
        s.close()
        srv.close()


def test_non_loopback_bind_without_token_is_a_start_error() -> None:
    with pytest.raises(ConfigError, match="--rpc-address binds '0.0.0.0'.*--cluster-token"):
        MasterConfig(rpc_address="tcp://0.0.0.0:0", cluster_token="")
    MasterConfig(rpc_address="tcp://0.0.0.0:0", cluster_token=TOKEN)
    MasterConfig(rpc_address="tcp://127.0.0.1:0", cluster_token="")
    assert TOKEN not in repr(MasterConfig(cluster_token=TOKEN))
    assert TOKEN not in repr(NodeConfig(cluster_token=TOKEN))


def test_master_process_refuses_clients_without_its_token() -> None:
    with store_cluster("tok", dram="4MiB", master_args=("--cluster-token", TOKEN),
                       node_args=("--cluster-token", TOKEN)) as (mst, _):
        addr = mst.info["address"]
        good = MasterConnection([addr], timeout_s=2.0, failover_s=0.0, token=TOKEN)
        stats = good.call(m.GetStats())
        assert stats.values["segments"] == 1  # type: ignore[attr-defined]  # the node mounted
        for token in ("", "wrong"):
            bad = MasterConnection([addr], timeout_s=0.5, failover_s=0.0, token=token)
            with pytest.raises((StoreError, OSError)):
                bad.call(m.GetStats())
            bad.close()
        s = socket.create_connection(parse_address(addr), timeout=5)  # a raw frame: no reply
        payload = encode(m.Exists(key="k"))
        s.sendall(struct.pack("<IQ", len(payload), 7) + payload)
        assert s.recv(12) == b""
        s.close()
        assert good.call(m.Exists(key="k")).values == [False]  # type: ignore[attr-defined]
        good.close()
