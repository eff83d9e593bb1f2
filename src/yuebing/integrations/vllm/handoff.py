"""`Handoff`: the prefill → decode hand-off of two vLLM instances; `instance.VllmInstance` owns one.

The prefill `tell`s the decode `KvReady` with the first token (``on_ready``, called from a
transfer-engine thread). Layer-wise (the default): the decode owns the receive pool
(`stream.RecvPool`, a shared-memory segment; `take` at `Reserve`, `give_back` once its vLLM
read them); the prefill's vLLM writes the prompt's KV there layer by layer and tells the decode
with `KvStreamed` (``on_streamed``). Without pool blocks it goes through the store: the
prefill's connector saves every full store block, `wait_stored` waits (at most ``wait_s``)
until the store holds them before `KvReady` is sent, and the decode's connector loads them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from yuebing.integrations.vllm.layout import KvLayout
from yuebing.integrations.vllm.stream import KV_STREAMED_TOPIC, RecvPool, pool
from yuebing.protocol import ProtocolError, decode, encode
from yuebing.protocol.instance import KvReady, KvStreamed
from yuebing.transfer import TransferConfig, TransferEngine

log = logging.getLogger(__name__)

KV_READY_TOPIC = "yuebing.kv_ready"
"""The notification topic of `KvReady` (= `yuebing.instance.prefill.KV_READY_TOPIC`)."""


class Handoff:
    """A transfer engine for `KvReady` / `KvStreamed` notifications and the decode's receive
    pool of ``pool_blocks`` blocks, and a store client for the prefill's wait; ``on_ready(msg)``
    / ``on_streamed(msg)`` are called from a transfer-engine thread when one arrives."""

    def __init__(self, host: str, layout: KvLayout, master: str, wait_s: float = 5.0,
                 on_ready: Callable[[KvReady], None] | None = None, pool_blocks: int = 0,
                 on_streamed: Callable[[KvStreamed], None] | None = None) -> None:
        self.layout = layout
        self.wait_s = wait_s
        self.transfer = TransferEngine(TransferConfig(host=host, metadata="p2p"))
        self.pool: RecvPool = pool(layout, pool_blocks)
        self.transfer.register_segment("kv", size=max(4096, self.pool.nbytes))
        self.segment = self.transfer.segment_name("kv")
        self.free: list[int] = list(range(pool_blocks))
        self.on_ready = on_ready
        self.on_streamed = on_streamed
        self.transfer.on_notify(self._notified)
        self.store: Any = None
        if master:
            from yuebing.store.client.client import StoreClient
            from yuebing.store.config import ClientConfig
            self.store = StoreClient(ClientConfig(master=master, rpc_timeout_s=wait_s,
                                                  failover_s=wait_s))

    def take(self, tokens: int) -> list[int]:
        """Pool blocks for a prompt of ``tokens`` tokens, or none if the pool lacks them."""
        n = -(-tokens // self.layout.block_tokens)
        if n > len(self.free) or n == 0:
            return []
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def _notified(self, n: Any) -> None:
        handlers: dict[str, tuple[type[KvReady] | type[KvStreamed], Callable[[Any], None] | None]]
        handlers = {KV_STREAMED_TOPIC: (KvStreamed, self.on_streamed),
                    KV_READY_TOPIC: (KvReady, self.on_ready)}
        kind, handle = handlers.get(n.topic, (KvReady, None))
        if handle is None:
            return
        try:
            msg = decode(n.payload, kind)
        except ProtocolError as e:
            log.warning("bad %s from %s: %s", kind.__name__, n.sender, e)
            return
        handle(msg)

    def wait_stored(self, token_ids: list[int]) -> int:
        """Blocking (an executor thread): wait until the store holds every full store block of
        the prompt, at most ``wait_s``; returns how many it holds (the decode computes the
        rest)."""
        keys = self.layout.store_keys(token_ids)
        if not keys or self.store is None:
            return 0
        end = time.monotonic() + self.wait_s
        held = 0
        while True:
            try:
                with self.store.limited(self.wait_s):
                    held = int(self.store.prefix_match(keys))
            except Exception as e:  # noqa: BLE001 - the decode computes what is missing
                log.warning("store lookup for the hand-off failed: %s", e)
                return held
            if held >= len(keys) or time.monotonic() >= end:
                return held
            time.sleep(0.02)

    def tell(self, segment: str, msg: KvReady) -> str:
        """Blocking: send `KvReady` to the decode owning ``segment``; '' or the error."""
        try:
            self.transfer.notify(segment, KV_READY_TOPIC, encode(msg), timeout_s=self.wait_s)
        except Exception as e:  # noqa: BLE001 - reported to the Conductor as the task's error
            return str(e)
        return ""

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.transfer.close()
