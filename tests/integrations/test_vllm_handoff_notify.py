"""`Handoff` turns transfer-engine notifications into `KvReady` / `KvStreamed` calls: each
topic to its own callback, a payload that does not decode is logged and dropped, and other
topics are ignored (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from yuebing.integrations.vllm.handoff import KV_READY_TOPIC, Handoff
from yuebing.integrations.vllm.layout import KvLayout
from yuebing.integrations.vllm.stream import KV_STREAMED_TOPIC
from yuebing.protocol import encode
from yuebing.protocol.instance import KvReady, KvStreamed

LAYOUT = KvLayout(model="m", dtype="float32", layers=2, kv_heads=1, head_size=4,
                  block_tokens=2, store_block_tokens=4)


def test_each_topic_reaches_its_callback_and_bad_payloads_are_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    ready: list[KvReady] = []
    streamed: list[KvStreamed] = []
    h = Handoff("127.0.0.1", LAYOUT, "", on_ready=ready.append, on_streamed=streamed.append)
    try:
        r = KvReady(request_id="r1", num_tokens=5, first_token=7, first_token_time_s=1.0,
                    prefill_end_s=1.0)
        s = KvStreamed(request_id="r1", ok=True, layers=2, layers_before_last=1, bytes=64,
                       last_layer_at_s=1.0, complete_at_s=1.1)
        h._notified(SimpleNamespace(topic=KV_READY_TOPIC, payload=encode(r), sender="p"))
        h._notified(SimpleNamespace(topic=KV_STREAMED_TOPIC, payload=encode(s), sender="p"))
        h._notified(SimpleNamespace(topic=KV_READY_TOPIC, payload=encode(s), sender="p"))
        h._notified(SimpleNamespace(topic="other", payload=encode(r), sender="p"))
        assert ready == [r] and streamed == [s]
        assert "bad KvReady from p" in caplog.text
    finally:
        h.transfer.close()
