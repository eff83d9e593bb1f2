"""OpenAI response bodies and SSE events for completions and chat completions.

Called by the HTTP routes (`yuebing.conductor.server`) as `Delta`s arrive: `Renderer.chunk`
per delta (``data: {...}\\n\\n``), `Renderer.usage_chunk` at the end of a stream that asked for
``stream_options.include_usage``, `Renderer.full` for a non-streamed response. The usage carries
``prompt_tokens_details.cached_tokens`` and the ``yuebing`` extension (the request's timing
breakdown, `RequestStats.extension`).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from yuebing.conductor.stats import RequestStats

DONE = b"data: [DONE]\n\n"
_enc = msgspec.json.Encoder()


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


class Renderer:
    """Bodies of one response (``chat`` or text completion) for model ``model``."""

    __slots__ = ("chat", "model", "id", "created", "include_usage", "token_ids", "_object")

    def __init__(self, chat: bool, model: str, request_id: str, include_usage: bool,
                 token_ids: bool = False) -> None:
        self.chat = chat
        self.token_ids = token_ids
        """Add each choice's generated ``token_ids`` (vLLM's ``return_token_ids``)."""
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self._object = "chat.completion.chunk" if chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": self._object, "created": self.created,
                               "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def role_chunk(self) -> bytes:
        return sse(self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]))

    def chunk(self, text: str, finish_reason: str | None, ids: list[int] | None = None
              ) -> bytes:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.token_ids:
            choice["token_ids"] = ids or []
        return sse(self._envelope([choice]))

    def usage_chunk(self, stats: RequestStats) -> bytes:
        out = self._envelope([])
        out["usage"] = usage(stats)
        return sse(out)

    def full(self, text: str, stats: RequestStats, ids: list[int] | None = None) -> bytes:
        reason = stats.finish_reason or "stop"
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        if self.token_ids:
            choice["token_ids"] = ids or []
        return _enc.encode({"id": self.id, "object": obj, "created": self.created,
                            "model": self.model, "choices": [choice], "usage": usage(stats)})


def usage(stats: RequestStats) -> dict[str, Any]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "yuebing": stats.extension()}


def error_event(message: str, code: str, type: str = "server_error") -> bytes:
    return sse({"error": {"message": message, "type": type, "param": None, "code": code}})
