"""vLLM's KV-cache events → the store-block keys of a vLLM instance's prefix cache
(`integrations.vllm.events.KvEventIndex`), without vLLM: a frame as vLLM 0.32's
``ZmqEventPublisher`` sends it (bytes captured from its encoder), the keys equal to
`KvLayout.block_keys` (what the Conductor's index speaks), removal, clearing, lost events."""

from __future__ import annotations

import random

import msgspec

from yuebing.integrations.vllm.events import KvEventIndex
from yuebing.integrations.vllm.layout import KvLayout

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
    assert idx.take() == ([], [])  # stored, removed and cleared in one batch: nothing
    idx.apply([stored([11, b"\x01\x02"], None, [1, 2, 3, 4])])
    assert idx.take() == (LAYOUT.block_keys([1, 2, 3, 4]), [])
    idx.apply([{"type": "AllBlocksCleared"}])
    assert idx.take() == ([], LAYOUT.block_keys([1, 2, 3, 4]))


def test_keys_chain_across_events_like_the_conductors():
    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(11)]
    idx = KvEventIndex(LAYOUT)
    idx.apply([stored([1, 2, 3], None, prompt[:6])])
    idx.apply([stored([4, 5], 3, prompt[6:10])])
    added, _ = idx.take()
    assert sorted(LAYOUT.block_keys(prompt)) == added and len(added) == 2
    idx.dropped([4])  # the second store block lost one of its vLLM blocks
    assert idx.take() == ([], [LAYOUT.block_keys(prompt)[1]])


def test_blocks_after_lost_events_are_skipped_not_guessed():
    idx = KvEventIndex(LAYOUT)
    idx.frame([b"", (5).to_bytes(8, "big"), msgspec.msgpack.encode(
        [1.0, [stored([7, 8], 99, [1, 2, 3, 4])], None])])
    idx.frame([b"", (9).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [], None])])
    assert idx.take() == ([], []) and idx.skipped == 2 and idx.gaps == 1
    idx.apply([stored([1, 2], None, [1, 2, 3, 4]) | {"block_size": 16}])  # another geometry
    assert idx.take() == ([], [])
