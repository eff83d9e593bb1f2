"""Store keys of KV: one function maps a token prefix to the keys every component speaks.

A *store block* is ``store_block_tokens`` tokens (default 256 = 16 engine blocks of 16) of KV
for all layers, kept as one store object laid out like `KVPool.export_blocks`
(``[engine blocks, layers, 2, kv_heads, block_size, head_dim]``). Its key is the chained
`hash_block` over store-block-sized chunks with the engine's KV fingerprint in ``extra``, so a
fingerprint mismatch is a different key: a miss, never wrong KV. Called by the KV connector
(instances), the Conductor's KV index and tests.
"""

from __future__ import annotations

from collections.abc import Sequence

from yuebing.core.hashing import hash_blocks
from yuebing.core.ids import BlockHash

KEY_PREFIX = "kv/"


def store_block_keys(token_ids: Sequence[int], store_block_tokens: int,
                     fingerprint: str) -> list[BlockHash]:
    """Chained keys of every full store block of ``token_ids``."""
    if not fingerprint:
        raise ValueError("store block keys need the engine's KV fingerprint")
    return hash_blocks(list(token_ids), store_block_tokens, ("kv-store", fingerprint))


def store_key(fingerprint: str, key: BlockHash) -> str:
    """The store object name of one store block (readable: model name, then the hash)."""
    name = fingerprint.split(":", 1)[0].replace("/", "_")
    return f"{KEY_PREFIX}{name}/{key:016x}"


def store_keys(token_ids: Sequence[int], store_block_tokens: int, fingerprint: str) -> list[str]:
    return [store_key(fingerprint, k)
            for k in store_block_keys(token_ids, store_block_tokens, fingerprint)]


def parse_store_key(name: str) -> BlockHash | None:
    """The block hash of a store object name made by `store_key` (None for other objects)."""
    if not name.startswith(KEY_PREFIX):
        return None
    try:
        return BlockHash(int(name.rsplit("/", 1)[1], 16))
    except (IndexError, ValueError):
        return None
