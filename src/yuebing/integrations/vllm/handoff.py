"""`Handoff`: the prefill → decode hand-off between two vLLM instances, through the yuebing
store. `instance.VllmInstance` owns one in the prefill and decode roles.

A disaggregated request's life: the Conductor's `Reserve` reaches the decode instance, which
answers `Reserved` with its transfer-engine segment (nothing is written into it: vLLM's KV
stays in vLLM) and keeps the request (`reserve`); the prefill instance runs the prompt with
``max_tokens`` 1, its `YuebingConnector` saving every full store block; once the store holds
them (`wait_stored`, bounded by ``wait_s``) it tells the decode with `KvReady` through the
transfer engine (`tell`; topic `KV_READY_TOPIC`, as yuebing's own prefill); the decode
(`_notified` → ``on_ready``) asks its vLLM for the rest with the prompt plus the first token,
and its connector loads the stored blocks (the tail past the last full store block, and the
first token, are computed there). Not layer-wise: the decode starts once the prefill is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from yuebing.integrations.vllm.layout import KvLayout
from yuebing.protocol import ProtocolError, decode, encode
from yuebing.protocol.instance import KvReady
from yuebing.transfer import TransferConfig, TransferEngine

log = logging.getLogger(__name__)

KV_READY_TOPIC = "yuebing.kv_ready"
"""The notification topic of `KvReady` (= `yuebing.instance.prefill.KV_READY_TOPIC`)."""


class Handoff:
    """A transfer engine for `KvReady` notifications and a store client for the prefill's
    wait; ``on_ready(msg)`` is called from a transfer-engine thread when one arrives."""

    def __init__(self, host: str, layout: KvLayout, master: str, wait_s: float = 5.0,
                 on_ready: Callable[[KvReady], None] | None = None) -> None:
        self.layout = layout
        self.wait_s = wait_s
        self.transfer = TransferEngine(TransferConfig(host=host, metadata="p2p"))
        self.transfer.register_segment("kv", size=4096)
        self.segment = self.transfer.segment_name("kv")
        self.on_ready = on_ready
        self.transfer.on_notify(self._notified)
        self.store: Any = None
        if master:
            from yuebing.store.client.client import StoreClient
            from yuebing.store.config import ClientConfig
            self.store = StoreClient(ClientConfig(master=master, rpc_timeout_s=wait_s,
                                                  failover_s=wait_s))

    def _notified(self, n: Any) -> None:
        if n.topic != KV_READY_TOPIC or self.on_ready is None:
            return
        try:
            msg = decode(n.payload, KvReady)
        except ProtocolError as e:
            log.warning("bad KvReady from %s: %s", n.sender, e)
            return
        assert isinstance(msg, KvReady)
        self.on_ready(msg)

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
