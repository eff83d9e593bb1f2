"""Layer-wise hand-off between two vLLM workers' halves (`integrations.vllm.stream`) over a
real transfer engine, without vLLM: a prefill's paged blocks, written layer by layer into a
decode's receive pool, read back into other paged blocks byte for byte; the decode is told
with `KvStreamed`; a dead pool fails the stream, which the decode hears of."""

from __future__ import annotations

import torch

from yuebing.integrations.vllm.layout import KvLayout
from yuebing.integrations.vllm.stream import (
    KV_STREAMED_TOPIC,
    LayerReceiver,
    LayerSender,
    StreamJob,
    pool,
    runs,
)
from yuebing.protocol import decode
from yuebing.protocol.instance import KvStreamed
from yuebing.transfer import TransferConfig, TransferEngine

LAYOUT = KvLayout(model="m", dtype="float32", layers=3, kv_heads=2, head_size=4,
                  block_tokens=4, store_block_tokens=8)


def paged(n: int, fill: bool) -> list[torch.Tensor]:
    shape = (n, *LAYOUT.block_shape)
    return [torch.randn(shape) if fill else torch.zeros(shape) for _ in range(LAYOUT.layers)]


def test_runs_merge_consecutive_blocks_on_both_sides():
    assert runs((3, 4, 5, 9), (0, 1, 7, 8)) == [(3, 0, 2), (5, 7, 1), (9, 8, 1)]


def test_a_prompt_goes_layer_by_layer_into_the_pool_and_back_into_other_blocks():
    with TransferEngine(TransferConfig(metadata="p2p")) as owner, \
            TransferEngine(TransferConfig(metadata="p2p")) as pe, \
            TransferEngine(TransferConfig(metadata="p2p")) as de:
        rp = pool(LAYOUT, 8)
        owner.register_segment("kv", size=rp.nbytes)
        seg = owner.segment_name("kv")
        src, dst = paged(10, True), paged(10, False)
        sender = LayerSender(LAYOUT, pe)
        # two steps: blocks 2, 7 (the second partial), then 7 again and 8 (the end)
        steps = [StreamJob("v", "r1", seg, 8, (2, 7), (5, 0)),
                 StreamJob("v", "r1", seg, 8, (7, 8), (0, 1), last=True)]
        for job in steps:
            for li in range(LAYOUT.layers):
                sender.send_layer(li, src[li], [job])
            sender.end_step([job])
        note = owner.next_notify(5.0)
        assert note is not None and note.topic == KV_STREAMED_TOPIC
        msg = decode(note.payload, KvStreamed)
        assert isinstance(msg, KvStreamed)
        assert (msg.request_id, msg.ok, msg.layers) == ("r1", True, 3)
        assert msg.bytes == 4 * LAYOUT.layers * LAYOUT.block_bytes
        assert 0 <= msg.layers_before_last <= 3 and msg.complete_at_s >= msg.last_layer_at_s
        recv = LayerReceiver(LAYOUT, de)
        recv.start([StreamJob("d", "r1", seg, 8, (1, 3, 4), (5, 0, 1))], dst)
        for li in range(LAYOUT.layers):
            recv.wait_layer(li)
            assert torch.equal(dst[li][[1, 3, 4]], src[li][[2, 7, 8]])
            assert not dst[li][[0, 2, 5]].any()
        assert recv.load_errors() == set()
        late = StreamJob("v", "r3", seg, 8, (1,), (2,), last=True, expires_at_s=1.0)
        sender.send_layer(0, src[0], [late])  # the reservation has expired: nothing written
        sender.end_step([late])
        note = owner.next_notify(5.0)
        assert note is not None
        msg = decode(note.payload, KvStreamed)
        assert isinstance(msg, KvStreamed) and not msg.ok and "expires" in msg.error
        sender.close()


def test_a_missing_pool_fails_the_stream_and_the_read():
    with TransferEngine(TransferConfig(metadata="p2p")) as owner, \
            TransferEngine(TransferConfig(metadata="p2p")) as pe:
        owner.register_segment("kv", size=pool(LAYOUT, 8).nbytes)
        good = owner.segment_name("kv")
        gone = good.rsplit("/", 1)[0] + "/nothing"
        sender = LayerSender(LAYOUT, pe, timeout_s=2.0)
        job = StreamJob("v", "r2", gone, 8, (0,), (0,), last=True)
        for li in range(LAYOUT.layers):
            sender.send_layer(li, paged(2, True)[li], [job])
        sender.end_step([job])  # nothing to tell: the pool's owner is not there
        assert sender.stats["stream_failures"] == 1
        recv = LayerReceiver(LAYOUT, pe, timeout_s=2.0)
        recv.start([StreamJob("d", "r2", gone, 8, (1, 2), (0, 1))], paged(3, False))
        recv.end()
        assert recv.load_errors() == {1, 2}
        sender.close()
