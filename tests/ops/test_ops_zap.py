"""`ops.zap`: a ROUTER served with the cluster token takes messages only from DEALERs that
present it; the others fail the handshake and none of their messages arrive."""

from __future__ import annotations

import time

import zmq

from yuebing.ops.zap import TokenAuthenticator, dial_plain, serve_plain

TOKEN = "tok-123"


def _recv(sock: zmq.Socket, timeout_s: float) -> list[bytes] | None:
    if sock.poll(int(timeout_s * 1000)):
        return sock.recv_multipart()
    return None


def test_only_peers_with_the_token_get_through() -> None:
    ctx = zmq.Context()
    zap = TokenAuthenticator(ctx, TOKEN)
    zap.start()
    router = ctx.socket(zmq.ROUTER)
    serve_plain(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client_ctx = zmq.Context()
    dealers = []
    try:
        for token in ("", "wrong", TOKEN):
            d = client_ctx.socket(zmq.DEALER)
            d.linger = 0
            if token:
                dial_plain(d, token)
            d.connect(f"tcp://127.0.0.1:{port}")
            d.send(token.encode() or b"none")
            dealers.append(d)
        got = _recv(router, 5.0)
        assert got is not None and got[1] == TOKEN.encode()
        assert _recv(router, 0.5) is None  # neither the tokenless nor the wrong one arrives
        end = time.monotonic() + 5
        while zap.denied < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert zap.denied >= 1  # the wrong token reached the handler and was refused
    finally:
        for d in dealers:
            d.close()
        router.close(linger=0)
        zap.stop()
        ctx.term()
        client_ctx.term()
