"""The master's local socket: a client on the master's host reaches it through the abstract Unix
socket named after its TCP address (`wire.local_name`), with the same token check; one on
another host, with the option off at either end, or facing a name it cannot trust, uses TCP."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from yuebing.ops.ports import free_port
from yuebing.protocol.store import Bools, Exists
from yuebing.store.client.rpc import AsyncMasterConnection, MasterConnection
from yuebing.store.wire import FrameSocket, local_name, local_names
from yuebing.store.wire_server import FrameServer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="abstract Unix sockets are Linux's")


def _echo(address: str = "tcp://127.0.0.1:0", local: bool = True, token: str = "") -> FrameServer:
    srv: FrameServer

    def on_frame(cid: int, rid: int, payload: bytes) -> None:
        srv.send(cid, rid, payload[::-1])

    srv = FrameServer(address, on_frame, local=local, token=token)
    return srv


def _roundtrip(srv: FrameServer, sock: FrameSocket, payload: bytes) -> tuple[int, bytes] | None:
    sock.send(7, payload)
    for _ in range(200):
        srv.poll(0.01)
        got = sock.recv(0.01)
        if got is not None:
            return got
    return None


def test_a_client_on_the_masters_host_goes_through_the_local_socket() -> None:
    srv = _echo()
    sock = FrameSocket(srv.address, 2.0)
    try:
        assert sock.local
        assert _roundtrip(srv, sock, b"abc") == (7, b"cba")
        (conn,) = srv.conns.values()
        assert conn.peer == f"local pid {os.getpid()}"  # named by its process in the logs
    finally:
        sock.close()
        srv.close()


@pytest.mark.parametrize("server_local, client_local", [(False, True), (True, False)])
def test_either_end_turned_off_means_tcp(server_local: bool, client_local: bool) -> None:
    srv = _echo(local=server_local)
    sock = FrameSocket(srv.address, 2.0, local=client_local)
    try:
        assert not sock.local
        assert _roundtrip(srv, sock, b"abc") == (7, b"cba")
        (conn,) = srv.conns.values()
        assert conn.peer.startswith("127.0.0.1:")
    finally:
        sock.close()
        srv.close()


def test_a_master_bound_to_every_address_serves_loopback_clients_locally() -> None:
    port = free_port("127.0.0.1")
    srv = _echo(f"tcp://0.0.0.0:{port}")
    sock = FrameSocket(f"tcp://127.0.0.1:{port}", 2.0)
    try:
        assert sock.local
        assert _roundtrip(srv, sock, b"xyz") == (7, b"zyx")
    finally:
        sock.close()
        srv.close()


def test_only_addresses_of_this_host_have_local_names() -> None:
    assert local_names("tcp://127.0.0.1:5000") == [local_name("127.0.0.1", 5000),
                                                  local_name("0.0.0.0", 5000)]
    assert local_names("tcp://192.0.2.1:5000") == []  # TEST-NET-1: no host has it
    with pytest.raises(ValueError, match="tcp://127.0.0.1:50151"):
        local_names("127.0.0.1")


def test_the_token_is_checked_on_the_local_socket_too() -> None:
    srv = _echo(token="right")
    good = FrameSocket(srv.address, 2.0, token="right")
    bad = FrameSocket(srv.address, 2.0, token="wrong")
    try:
        assert good.local and bad.local
        assert _roundtrip(srv, good, b"ok") == (7, b"ko")
        with pytest.raises(ConnectionError):
            for _ in range(200):  # closed unanswered
                srv.poll(0.01)
                bad.send(1, b"hi")
                bad.recv(0.01)
    finally:
        good.close()
        bad.close()
        srv.close()


def test_a_name_held_by_another_socket_leaves_tcp_working() -> None:
    """The name is taken (a process squats it, listening or not): the master serves TCP only
    and says so; a client finding nobody trustworthy listening there uses TCP."""
    port = free_port("127.0.0.1")
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squat.bind(local_name("127.0.0.1", port))
    try:
        srv = _echo(f"tcp://127.0.0.1:{port}")
        assert srv.usock is None
        sock = FrameSocket(srv.address, 2.0)
        try:
            assert not sock.local  # nobody listens on the squatted name: refused, then TCP
            assert _roundtrip(srv, sock, b"abc") == (7, b"cba")
        finally:
            sock.close()
            srv.close()
    finally:
        squat.close()


def test_a_closed_master_frees_its_name_for_the_next() -> None:
    port = free_port("127.0.0.1")
    for _ in range(2):
        srv = _echo(f"tcp://127.0.0.1:{port}")
        assert srv.usock is not None
        srv.close()


def _exists_server() -> FrameServer:
    from yuebing.protocol.codec import decode, encode
    srv: FrameServer

    def on_frame(cid: int, rid: int, payload: bytes) -> None:
        msg = decode(payload)
        srv.send(cid, rid, encode(Bools(values=[msg.key == "here"])))

    srv = FrameServer("tcp://127.0.0.1:0", on_frame)
    return srv


def test_blocking_and_async_master_connections_use_the_local_socket() -> None:
    import threading
    srv = _exists_server()
    stop = threading.Event()
    t = threading.Thread(target=lambda: [srv.poll(0.01) for _ in iter(stop.is_set, True)])
    t.start()
    try:
        conn = MasterConnection([srv.address], 2.0, 2.0)
        try:
            assert conn.call(Exists(key="here")) == Bools(values=[True])
            assert conn.call(Exists(key="gone")) == Bools(values=[False])
            assert conn.sock is not None and conn.sock.local
        finally:
            conn.close()

        async def run() -> None:
            aconn = AsyncMasterConnection([srv.address], 2.0, 2.0)
            try:
                assert await aconn.call(Exists(key="here")) == Bools(values=[True])
                assert aconn._writer is not None
                assert aconn._writer.get_extra_info("socket").family == socket.AF_UNIX
            finally:
                aconn.close()
        asyncio.run(run())
    finally:
        stop.set()
        t.join()
        srv.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="listening as another user needs root")
def test_a_name_another_user_listens_on_is_passed_over_for_tcp() -> None:
    """A squatter of another user listening on the name gets no connection (nor the token)."""
    port = free_port("127.0.0.1")
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter: another user, listening on the master's name
        try:
            os.setuid(65534)
            squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            squat.bind(local_name("127.0.0.1", port))
            squat.listen(8)
            os.write(ready_w, b"x")
            os.read(done_r, 1)  # until the test is done
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        srv = _echo(f"tcp://127.0.0.1:{port}")
        sock = FrameSocket(srv.address, 2.0, token="")
        try:
            assert srv.usock is None
            assert not sock.local
            assert _roundtrip(srv, sock, b"abc") == (7, b"cba")
        finally:
            sock.close()
            srv.close()
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)
