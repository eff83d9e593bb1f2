"""vLLM's KV-cache events → the store-block keys of a vLLM instance's prefix cache
(`integrations.vllm.events.KvEventIndex`), without vLLM: a frame as vLLM 0.32's
``ZmqEventPublisher`` sends it (bytes captured from its encoder), the keys equal to
`KvLayout.block_keys` (what the Conductor's index speaks), removal, clearing, lost events (replayed, or the index reset to a full resync), and the adapter
asking a fake vLLM publisher's replay endpoint (its ROUTER protocol, as in vLLM 0.32)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from yuebing.integrations.vllm.events import KvEventIndex
from yuebing.integrations.vllm.instance import VllmInstance, VllmInstanceConfig
from yuebing.integrations.vllm.layout import KvLayout
from yuebing.protocol import decode
from yuebing.protocol.instance import LoadReport, Subscribe

LAYOUT = KvLayout(model="m", dtype="float32", layers=2, kv_heads=1, head_size=4,
                  block_tokens=2, store_block_tokens=4)

VLLM_FRAME = (b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93\x88\xa4type\xabBlockStored\xacblock"
              b"_hashes\x92\x0b\xc4\x02\x01\x02\xb1parent_block_hash\xc0\xa9token_ids\x94\x01"
              b"\x02\x03\x04\xaablock_size\x02\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0"
              b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x0b\xa6medium\xa3GPU\x81\xa4type"
              b"\xb0AllBlocksCleared")
"""``KVEventBatch(ts=1.5, events=[BlockStored([11, b'\\x01\\x02'], None, [1, 2, 3, 4], 2),
BlockRemoved([11]), AllBlocksCleared()])`` through vLLM's msgpack encoder."""


def stored(hashes, parent, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 2, "lora_id": None, "medium": "GPU"}


def test_a_vllm_frame_stores_a_store_block_then_removes_and_clears_it():
    idx = KvEventIndex(LAYOUT)
    idx.frame([b"", (0).to_bytes(8, "big"), VLLM_FRAME + b"\xc0"])
    assert idx.take()[:2] == ([], [])  # stored, removed and cleared in one batch: nothing
    idx.apply([stored([11, b"\x01\x02"], None, [1, 2, 3, 4])])
    assert idx.take()[:2] == (LAYOUT.block_keys([1, 2, 3, 4]), [])
    idx.apply([{"type": "AllBlocksCleared"}])
    assert idx.take()[:2] == ([], LAYOUT.block_keys([1, 2, 3, 4]))


def test_keys_chain_across_events_like_the_conductors():
    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(11)]
    idx = KvEventIndex(LAYOUT)
    idx.apply([stored([1, 2, 3], None, prompt[:6])])
    idx.apply([stored([4, 5], 3, prompt[6:10])])
    added, _, _ = idx.take()
    assert sorted(LAYOUT.block_keys(prompt)) == added and len(added) == 2
    idx.dropped([4])  # the second store block lost one of its vLLM blocks
    assert idx.take()[:2] == ([], [LAYOUT.block_keys(prompt)[1]])


def frame(seq, *events):
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, list(events), None])]


def test_blocks_after_unknown_parents_are_skipped_not_guessed():
    idx = KvEventIndex(LAYOUT)
    idx.frame(frame(0, stored([7, 8], 99, [1, 2, 3, 4])))
    assert idx.take()[:2] == ([], []) and idx.skipped == 2
    idx.apply([stored([1, 2], None, [1, 2, 3, 4]) | {"block_size": 16}])  # another geometry
    assert idx.take()[:2] == ([], [])


A = [1, 2, 3, 4]
B = [5, 6, 7, 8]


def test_a_gap_is_closed_by_the_replay_and_repeats_are_skipped():
    idx = KvEventIndex(LAYOUT)
    assert idx.frame(frame(0, stored([1, 2], None, A))) is None
    lost = frame(1, {"type": "BlockRemoved", "block_hashes": [2]})
    live = frame(2, stored([3, 4], None, B))
    assert idx.frame(live) == 1 and idx.gaps == 1  # nothing applied yet
    assert idx.take() == (LAYOUT.block_keys(A), [], False)
    assert not idx.replay([frame(3)])  # does not reach back to 1: refused, nothing applied
    assert idx.last_seq == 0
    assert idx.replay([lost, live]) and idx.replays == 1
    assert idx.frame(live, live=False) is None  # the live frame again: a repeat
    assert idx.take() == (LAYOUT.block_keys(B), LAYOUT.block_keys(A), False)


def test_an_unreplayable_gap_resets_the_index_to_a_full_resync():
    idx = KvEventIndex(LAYOUT)
    idx.frame(frame(0, stored([1, 2], None, A)))
    idx.take()
    live = frame(7, stored([3, 4], None, B))
    assert idx.frame(live) == 1
    idx.reset(6)
    assert idx.frame(live) is None and idx.resets == 1
    assert idx.take() == (LAYOUT.block_keys(B), [], True)  # A may be gone: not claimed
    assert idx.take() == ([], [], False)


def test_a_restarted_publisher_starts_the_index_over():
    idx = KvEventIndex(LAYOUT)
    for seq in range(3):
        idx.frame(frame(seq, *([stored([1, 2], None, A)] if seq == 0 else [])))
    idx.take()
    assert idx.frame(frame(0, stored([3, 4], None, B))) is None
    assert idx.take() == (LAYOUT.block_keys(B), [], True)


def test_a_restart_whose_first_frames_were_lost_still_starts_over():
    idx = KvEventIndex(LAYOUT)
    for seq in range(6):
        idx.frame(frame(seq, *([stored([1, 2], None, A)] if seq == 0 else [])))
    idx.take()
    # the restarted publisher's frames 0-1 never arrived (slow joiner): frame 2 is a restart,
    # not a repeat, and what the old process held is no longer claimed
    assert idx.frame(frame(2, stored([3, 4], None, B))) is None
    assert idx.take() == (LAYOUT.block_keys(B), [], True) and idx.resets == 1


HF = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
      "hidden_size": 8, "head_dim": 4}


class FakePublisher:
    """vLLM 0.32's ``ZmqEventPublisher`` wire protocol: PUB connecting to the adapter, and a
    ROUTER replay endpoint answering ``[id, b"", start]`` with ``[id, b"", topic, seq,
    payload]`` per buffered frame from ``start``, then ``[id, b"", b"", -1, b""]``."""

    def __init__(self, ctx, events_port, replay_port):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.connect(f"tcp://127.0.0.1:{events_port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer = []
        self.asked = []

    def publish(self, parts, drop=False):
        self.buffer.append(parts)
        if not drop:
            self.pub.send_multipart(parts)

    def serve_replay(self, keep_from=0):
        ident, _, start = self.router.recv_multipart()
        self.asked.append(int.from_bytes(start, "big"))
        for parts in self.buffer[keep_from:]:
            if int.from_bytes(parts[1], "big") >= self.asked[-1]:
                self.router.send_multipart([ident, b"", *parts])
        self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("buffered", [True, False])
def test_the_adapter_replays_lost_events_from_vllms_endpoint_or_resets(tmp_path, buffered):
    """A frame dropped on the way (as a full SUB queue drops them): the adapter asks the replay
    endpoint from the lost one; with vLLM's buffer still holding it the index is exact, with
    the buffer past it (``keep_from``) the next report is a full resync of what follows."""
    (tmp_path / "config.json").write_text(json.dumps(HF))
    events, replay = free_port(), free_port()
    inst = VllmInstance(VllmInstanceConfig(
        startup_profile=False, vllm_url="http://127.0.0.1:9", model_dir=str(tmp_path), block_size=64,
        store_block_tokens=128, kv_events_port=events, kv_replay_port=replay))
    lay = inst.layout
    a, b = list(range(128)), list(range(1000, 1128))

    def ev(hashes, tokens):
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": tokens, "block_size": 64}

    async def main():
        sub = inst.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{events}")
        pub = FakePublisher(zmq.Context.instance(), events, replay)
        task = asyncio.get_running_loop().create_task(inst._kv_events(sub))
        try:
            while inst.kv_index.last_seq < 0:  # the PUB→SUB connection takes a moment
                pub.buffer.clear()
                pub.publish(frame(0, ev([1, 2], a)))
                await asyncio.sleep(0.05)  # poll period while the connection forms
            inst.kv_index.take()
            pub.publish(frame(1, {"type": "BlockRemoved", "block_hashes": [1]}), drop=True)
            pub.publish(frame(2, ev([3, 4], b)))
            await asyncio.to_thread(pub.serve_replay, 0 if buffered else 2)
            while inst.kv_index.last_seq < 2:
                await asyncio.sleep(0.01)  # poll period
            return pub.asked
        finally:
            task.cancel()
            sub.close()
            pub.pub.close()
            pub.router.close()

    try:
        assert asyncio.run(main()) == [1]
        if buffered:
            assert inst.kv_index.replays == 1
            assert inst.kv_index.take() == (lay.block_keys(b), lay.block_keys(a), False)
        else:
            assert inst.kv_index.resets == 1
            assert inst.kv_index.take() == (lay.block_keys(b), [], True)
    finally:
        inst.sock.close()
        inst.ctx.term()


def test_a_resubscribing_conductor_gets_a_full_resync_report(tmp_path):
    """The Conductor asks for a full resync by subscribing again (a report sequence gap): the
    adapter's next report carries every key held, not the changes since the last one."""
    (tmp_path / "config.json").write_text(json.dumps(HF))
    inst = VllmInstance(VllmInstanceConfig(startup_profile=False, vllm_url="http://127.0.0.1:9",
                                           model_dir=str(tmp_path), block_size=64,
                                           store_block_tokens=128))
    sent = []
    inst.sock = SimpleNamespace(send_multipart=lambda parts, flags=0: sent.append(parts[1]),
                                close=inst.sock.close)
    keys = inst.layout.block_keys(list(range(128)))
    try:
        inst.kv_index.apply([{"type": "BlockStored", "block_hashes": [1, 2],
                              "parent_block_hash": None, "token_ids": list(range(128)),
                              "block_size": 64}])
        inst.dispatch(b"c", Subscribe(seq=1))
        inst._report()
        inst._report()
        inst.dispatch(b"c", Subscribe(seq=2))
        inst._report()
        reports = [decode(f) for f in sent if isinstance(decode(f), LoadReport)]
        assert [(r.cache_added, r.cache_full_resync) for r in reports] == \
            [(keys, True), ([], False), (keys, True)]
    finally:
        inst.sock.close()
        inst.ctx.term()
