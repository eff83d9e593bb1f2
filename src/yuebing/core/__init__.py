"""Leaf types shared by every package: ids, the one prefix-hash function, registry, clock,
config helpers and errors. Imports the standard library only."""

from yuebing.core.clock import Clock, VirtualClock, WallClock
from yuebing.core.errors import ConfigError, YuebingError
from yuebing.core.hashing import BLOCK_HASH_ROOT, hash_block, hash_blocks
from yuebing.core.ids import BlockHash, InstanceId, RequestId, SegmentName
from yuebing.core.registry import Registry

__all__ = [
    "BLOCK_HASH_ROOT",
    "BlockHash",
    "Clock",
    "ConfigError",
    "InstanceId",
    "Registry",
    "RequestId",
    "SegmentName",
    "VirtualClock",
    "WallClock",
    "YuebingError",
    "hash_block",
    "hash_blocks",
]
