"""yuebing.store — Mooncake Store: a replicated DRAM + SSD pool of KV blocks.

Roles: the master (`master.service.MasterService`: metadata, allocation, leases, eviction, HA),
storage nodes (`node.service.StorageNode`: DRAM segment + SSD tier), and clients
(`StoreClient`, `AsyncStoreClient`: put/get/batch/zero-copy through the transfer engine).
See docs/structure.md and README.md ("Store").
"""

from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.client.gets import ChecksumError, NotFoundError
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig, MasterConfig, NodeConfig
from yuebing.store.events import KvEventSubscriber

__all__ = ["AsyncStoreClient", "ChecksumError", "ClientConfig", "KvEventSubscriber",
           "MasterConfig", "NodeConfig", "NotFoundError", "StoreClient", "StoreRpcError"]
