"""A decode reservation whose caller gave up (the decode was stopped past the call's timeout,
or the request was cancelled while waiting) is cancelled as soon as its late `Reserved`
arrives: otherwise the decode would hold those KV blocks for nobody until the reservation's
own timeout (found by tests/faults: SIGSTOP of the decode for 10 s left 28 blocks reserved).
A stand-in instance (a zmq ROUTER in this test) answers late on purpose."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from yuebing.instance.client import InstanceClient, InstanceUnavailable
from yuebing.protocol.codec import decode, encode
from yuebing.protocol.instance import Cancel, DecodeTarget, KvLayout, Reserve, Reserved, Sampling


async def _late_reservation() -> list[object]:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = InstanceClient(f"tcp://127.0.0.1:{port}", timeout_s=0.2, ctx=ctx, token="")
    seen: list[object] = []
    try:
        call = asyncio.ensure_future(client.reserve("r1", [1, 2, 3], Sampling(), timeout_s=5))
        ident, raw = await router.recv_multipart()
        req = decode(raw)
        assert isinstance(req, Reserve) and req.request_id == "r1"
        try:
            await call
            raise AssertionError("the call should have timed out")
        except InstanceUnavailable:
            pass
        layout = KvLayout(num_layers=1, num_blocks=4, block_size=16, chunk_bytes=1,
                          fingerprint="x")
        target = DecodeTarget(instance_id="d", segment="s", blocks=[0, 1], layout=layout)
        await router.send_multipart([ident, encode(Reserved(seq=req.seq, target=target))])
        _, raw = await asyncio.wait_for(router.recv_multipart(), 5)
        seen.append(decode(raw))
    finally:
        await client.close()
        router.close(0)
        ctx.term()
    return seen


def test_a_late_reservation_is_cancelled() -> None:
    [msg] = asyncio.run(_late_reservation())
    assert isinstance(msg, Cancel) and msg.request_id == "r1"
