"""Multi-process loopback: a peer process serves a segment; this process writes and reads it
over TCP and shared memory; contents are checked with digests computed by the peer itself."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import numpy as np
import pytest

from yuebing.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus

PEER_BYTES = 8 << 20


def peer_digest(eng: TransferEngine, reply: str, peer: str, offset: int, length: int) -> str:
    """Ask the peer process for the BLAKE2b of its own bytes [offset, offset+length)."""
    eng.notify(peer, "sum", f"{offset} {length} {reply}".encode(), timeout_s=10)
    note = eng.next_notify(10)
    assert note is not None and note.topic == "sum"
    return note.payload.decode()


def digest(buf: object) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_two_process_write_read_checksums(spawn_peer, make_engine, transport) -> None:
    peer = spawn_peer(PEER_BYTES)
    eng: TransferEngine = make_engine(metadata="p2p", transports=(transport,), lanes=3,
                                      slice_size=64 << 10, shm_workers=2)
    eng.register_segment("reply", size=4096)
    reply = eng.segment_name("reply")
    rng = np.random.default_rng(3)
    # uneven sizes and offsets: single slice, many slices, a remainder slice
    layout = [(0, 1000), (4096, 300_000), (1 << 20, 3 << 20), ((5 << 20) + 7, 65536)]
    blobs = [rng.integers(0, 256, n, dtype=np.uint8) for _, n in layout]
    st = eng.transfer([TransferRequest(OpCode.WRITE, b, peer.name, off)
                       for b, (off, _) in zip(blobs, layout, strict=True)], timeout_s=20)
    assert st.status == TransferStatus.DONE
    assert [r.transferred for r in st.requests] == [n for _, n in layout]
    for b, (off, n) in zip(blobs, layout, strict=True):
        assert peer_digest(eng, reply, peer.name, off, n) == digest(b)
    # read back, cut differently: each blob in two halves, into one contiguous buffer
    out = np.zeros(sum(n for _, n in layout), np.uint8)
    reqs, pos = [], 0
    for off, n in layout:
        h = n // 2
        reqs += [TransferRequest(OpCode.READ, out[pos:pos + h], peer.name, off),
                 TransferRequest(OpCode.READ, out[pos + h:pos + n], peer.name, off + h)]
        pos += n
    eng.transfer(reqs, timeout_s=20)
    assert digest(out) == digest(np.concatenate(blobs))


def test_async_batches_and_polling(spawn_peer, make_engine) -> None:
    peer = spawn_peer(PEER_BYTES)
    eng: TransferEngine = make_engine(metadata="p2p", transports=("tcp",), lanes=2,
                                      slice_size=1 << 20)
    data = np.arange(4 << 20, dtype=np.uint8)

    async def run() -> list[TransferStatus]:
        writes = [eng.transfer_async([TransferRequest(OpCode.WRITE, data[i << 20:(i + 1) << 20],
                                                      peer.name, i << 20)]) for i in range(4)]
        done = await asyncio.gather(*writes)
        out = np.zeros_like(data)
        bid = eng.submit([TransferRequest(OpCode.READ, out, peer.name, 0)])
        first = eng.status(bid).status
        final = await eng.wait_async(bid)
        eng.free(bid)
        assert (out == data).all()
        return [first, final.status] + [s.status for s in done]

    statuses = asyncio.run(run())
    assert statuses[0] in (TransferStatus.PENDING, TransferStatus.TRANSFERRING, TransferStatus.DONE)
    assert statuses[1:] == [TransferStatus.DONE] * 5


def test_in_process_torch_segment_and_notify_callback(make_engine: Callable[..., TransferEngine]) -> None:
    torch = pytest.importorskip("torch")
    owner = make_engine(engine_id="owner-t")
    tensor = torch.zeros(1024, dtype=torch.float32)
    owner.register_segment("kv", buffer=tensor)
    got: list[tuple[str, bytes]] = []
    owner.on_notify(lambda n: got.append((n.topic, n.payload)))
    peer = make_engine(transports=("tcp",))
    src = torch.arange(16, dtype=torch.float32)
    peer.transfer([TransferRequest(OpCode.WRITE, src, "kv", 64)])
    assert tensor[16:32].tolist() == list(range(16)) and tensor[:16].sum().item() == 0
    peer.notify("kv", "layer-done", b"\x01")
    assert got == [("layer-done", b"\x01")]
    bid = peer.submit([TransferRequest(OpCode.READ, bytearray(64), "kv", 64)])
    with pytest.raises(Exception, match="still in flight|unknown batch"):
        peer.free(bid + 1000)  # type: ignore[operator]
    assert peer.wait(bid, 10).status == TransferStatus.DONE
    peer.free(bid)
