from yuebing.core.hashing import BLOCK_HASH_ROOT, hash_block, hash_blocks


def test_hash_is_stable_known_value() -> None:
    # Pinned: changing the hash invalidates every cache and store in a running cluster.
    assert BLOCK_HASH_ROOT == 0x215DC25013194268
    assert hash_block(None, [1, 2, 3]) == 0x4887F41CF97F64D7


def test_chain_depends_on_parent_tokens_and_extra() -> None:
    a = hash_block(None, [1, 2, 3])
    assert hash_block(a, [4]) != hash_block(None, [4])
    assert hash_block(None, [1, 2, 3], ("m1",)) != a
    assert hash_block(None, [1, 2, 3], ("m1",)) != hash_block(None, [1, 2, 3], ("m2",))
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2, 0])
    assert 0 <= a < 2**64


def test_hash_blocks_only_full_blocks_and_chained() -> None:
    toks = list(range(10))
    keys = hash_blocks(toks, 4)
    assert len(keys) == 2
    assert keys[0] == hash_block(None, toks[:4])
    assert keys[1] == hash_block(keys[0], toks[4:8])
    assert hash_blocks(toks[:3], 4) == []
    # a shared prefix gives shared leading keys
    assert hash_blocks(toks[:8] + [99, 98, 97, 96], 4)[:2] == keys
