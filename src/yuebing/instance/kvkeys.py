"""Store-block keys: the one mapping from a token prefix to KV keys in the store.

The KV connector of an instance (saving and loading prefix KV), the Conductor (its KV index
and the block keys it hands the policy) and tests all call `store_block_keys`, so a prefix
stored by one instance is found under the same keys by the Conductor and by every other
instance. A key is the chained `yuebing.core.hashing.hash_block` over store-block-sized
chunks of the prompt (full chunks only) with the KV fingerprint in ``extra``: instances whose
KV bytes differ (another model, weights, dtype or layout) never share a key. `store_key` is the
string under which the store holds a block's KV (or one layer range of it: a pipeline stage's
object); `parse_store_key` inverts it (the Conductor reads the store's KV events with it).
"""

from __future__ import annotations

from collections.abc import Sequence

from yuebing.core.hashing import hash_blocks
from yuebing.core.ids import BlockHash

KEY_PREFIX = "kv/"


def store_block_keys(token_ids: Sequence[int], store_block_tokens: int,
                     fingerprint: str) -> list[BlockHash]:
    """Chained keys of every full ``store_block_tokens`` chunk of ``token_ids``."""
    if store_block_tokens <= 0:
        raise ValueError(f"store_block_tokens must be positive, got {store_block_tokens}")
    if not fingerprint:
        raise ValueError("a KV fingerprint is required (an empty one would mix models' KV)")
    return hash_blocks(token_ids, store_block_tokens, (fingerprint,))


def store_key(fingerprint: str, key: int, layers: tuple[int, int] | None = None) -> str:
    """The store's key of block ``key``: ``kv/<fingerprint>/<key as 16 hex digits>``, and
    for the object of only ``layers`` [A, B) (a pipeline stage's) ``...@A:B``: ``fingerprint``
    and ``key`` are then the whole model's, so the group's range objects of a block sit beside
    the whole object a single instance writes, and a single instance can assemble them."""
    name = f"{KEY_PREFIX}{fingerprint}/{key:016x}"
    return name if layers is None else f"{name}@{layers[0]}:{layers[1]}"


def parse_store_key(name: str) -> tuple[str, BlockHash] | None:
    """(fingerprint, block key) of a whole-model `store_key` string; None for any other store
    key (a layer range's object too: the Conductor's index counts whole objects only)."""
    if not name.startswith(KEY_PREFIX):
        return None
    fingerprint, sep, hexkey = name[len(KEY_PREFIX):].rpartition("/")
    if not sep or not fingerprint or len(hexkey) != 16:
        return None
    try:
        return fingerprint, BlockHash(int(hexkey, 16))
    except ValueError:
        return None


def parse_range_key(name: str) -> tuple[str, BlockHash, str] | None:
    """(fingerprint, block key, ``"A:B"``) of a layer range's `store_key`; None otherwise."""
    base, sep, layers = name.rpartition("@")
    parsed = parse_store_key(base) if sep else None
    lo, colon, hi = layers.partition(":")
    if parsed is None or not (colon and lo.isdigit() and hi.isdigit()):
        return None
    return parsed[0], parsed[1], layers
