"""The one prefix-block hash function of the project.

Engine, store, conductor and simulator all call `hash_block` / `hash_blocks`, so a block
computed by a prefill instance has the same key in the store and in the conductor's index.

A block's key depends on its parent's key, its tokens and an ``extra`` tuple (the model
fingerprint, LoRA id, ...), so equal keys mean equal prefixes. The hash is BLAKE2b-64 with a
fixed seeded root: stable across processes, machines and Python versions (never ``hash()``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from yuebing.core.ids import BlockHash

_PERSON = b"yuebing-kv-v1"
BLOCK_HASH_ROOT = BlockHash(
    int.from_bytes(hashlib.blake2b(b"root", digest_size=8, person=_PERSON).digest(), "little")
)
"""Parent key of the first block of every sequence."""


def _encode_extra(extra: tuple[object, ...]) -> bytes:
    for item in extra:
        if not isinstance(item, str | int | bytes | bool | float | tuple | type(None)):
            raise TypeError(f"hash_block extra items must be plain values, got {type(item).__name__}")
    return repr(extra).encode()


def hash_block(
    parent: BlockHash | None, tokens: Sequence[int], extra: tuple[object, ...] = ()
) -> BlockHash:
    """Key of the block holding ``tokens`` whose preceding block has key ``parent``.

    ``parent=None`` means this is the first block (the fixed root is used). ``tokens`` are
    non-negative token ids (< 2**63). Equal (parent, tokens, extra) give equal keys everywhere.
    """
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update((BLOCK_HASH_ROOT if parent is None else parent).to_bytes(8, "little"))
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(_encode_extra(extra))
    return BlockHash(int.from_bytes(h.digest(), "little"))


def hash_blocks(
    tokens: Sequence[int], block_size: int, extra: tuple[object, ...] = ()
) -> list[BlockHash]:
    """Chained keys of every *full* block of ``tokens`` (a trailing partial block gets none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], extra)
        keys.append(parent)
    return keys
