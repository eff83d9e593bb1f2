"""A small real OpenAI-compatible HTTP server for the load generator's tests (FastAPI + uvicorn
on 127.0.0.1, an ephemeral port, in a thread).

It streams ``max_tokens`` SSE chunks per request (one token each) with controllable delays,
keeps an exact prefix cache over 16-token blocks of token-id prompts and reports its hits as
``usage.prompt_tokens_details.cached_tokens``, and misbehaves on request: `Behaviour.actions`
maps the n-th POST (0-based, in arrival order) to ``"429"`` (with ``Retry-After``), ``"500"``,
``"break"`` (the stream stops after one token without ``[DONE]``), ``"stream_error"`` (an error
event after one token), ``"hang"`` (no answer for 30 s), ``"no_tokens"`` (``[DONE]`` at once),
``"not_sse"`` (a plain JSON answer) or ``"bad_utf8"`` (an event that is not UTF-8);
``tokenizer_less`` streams empty text, like a model without a tokenizer. Every
request body is kept in `FakeServer.bodies`; `max_in_flight` is the most streams open at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

CACHE_BLOCK = 16


@dataclass
class Behaviour:
    models: tuple[str, ...] = ("fake-model",)
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    retry_after: str | None = "0"
    report_cached: bool = True
    report_usage: bool = True
    """Send the usage chunk when the request asks for it."""
    api_key: str | None = None
    """When set, every endpoint wants ``Authorization: Bearer <api_key>`` (401 otherwise)."""
    actions: dict[int, str] = field(default_factory=dict)
    tokenizer_less: bool = False
    """Stream every token with empty text, as a model without a tokenizer does (its ids only
    when the request asks ``return_token_ids``)."""


class FakeServer:
    """The app plus its state; `start` serves it, `stop` ends it."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.bodies: list[dict[str, Any]] = []
        self.cache: set[int] = set()
        self.app = FastAPI()
        self.app.get("/v1/models")(self._models)
        self.app.post("/v1/completions")(self._completions)
        self.app.post("/v1/chat/completions")(self._chat)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""
        self.in_flight = 0
        self.max_in_flight = 0
        """Streams open at once, at most (closed-loop tests)."""

    # --- serving ---------------------------------------------------------------------------

    def start(self) -> str:
        """Serve in a thread; the base URL once it listens."""
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=20)

    # --- handlers --------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        key = self.behaviour.api_key
        return key is None or request.headers.get("authorization") == f"Bearer {key}"

    async def _models(self, request: Request) -> Any:
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, 401)
        return {"object": "list", "data": [{"id": m, "object": "model"}
                                           for m in self.behaviour.models]}

    async def _completions(self, request: Request) -> Any:
        return await self._serve(request, chat=False)

    async def _chat(self, request: Request) -> Any:
        return await self._serve(request, chat=True)

    def _cached(self, prompt: Any) -> int:
        """Tokens of ``prompt``'s longest prefix of full blocks seen before; remembers it.
        Blocks are keyed by a chained hash (block k's key covers blocks 0..k)."""
        tokens = list(prompt) if isinstance(prompt, list) else [ord(c) for c in str(prompt)]
        hit, key, missed = 0, 0, False
        for k in range(len(tokens) // CACHE_BLOCK):
            key = hash((key, tuple(tokens[k * CACHE_BLOCK:(k + 1) * CACHE_BLOCK])))
            if key in self.cache and not missed:
                hit = (k + 1) * CACHE_BLOCK
            else:
                missed = True
                self.cache.add(key)
        return hit

    async def _serve(self, request: Request, chat: bool) -> Any:
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, 401)
        body = await request.json()
        number = len(self.bodies)
        self.bodies.append(body)
        action = self.behaviour.actions.get(number, "")
        if action == "429":
            headers = {} if self.behaviour.retry_after is None else {
                "Retry-After": self.behaviour.retry_after}
            return JSONResponse({"error": {"message": "overloaded"}}, 429, headers=headers)
        if action == "500":
            return JSONResponse({"error": {"message": "boom"}}, 500)
        if action == "not_sse":
            return JSONResponse({"choices": [{"text": "whole answer"}]})
        if body.get("model") not in self.behaviour.models:
            return JSONResponse({"error": {"message": "no such model"}}, 404)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": int(body["max_tokens"])}
        if self.behaviour.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": self._cached(prompt)}
        return StreamingResponse(self._stream(body, chat, action, usage),
                                 media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], chat: bool, action: str,
                      usage: dict[str, Any]) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            async for chunk in self._chunks(body, chat, action, usage):
                yield chunk
        finally:
            self.in_flight -= 1

    async def _chunks(self, body: dict[str, Any], chat: bool, action: str,
                      usage: dict[str, Any]) -> AsyncIterator[bytes]:
        def event(obj: Any) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        if action == "hang":
            await asyncio.sleep(30)  # the fake server hangs (behaviour under test)
        if chat:
            yield event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        # the fake's configured first-token delay:
        await asyncio.sleep(self.behaviour.first_token_delay_s)
        n = 0 if action == "no_tokens" else int(body["max_tokens"])
        for i in range(n):
            if i:
                await asyncio.sleep(self.behaviour.token_delay_s)
            text = "" if self.behaviour.tokenizer_less else f" t{i}"
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}} if chat else {
                "index": 0, "text": text}
            if body.get("return_token_ids"):
                choice["token_ids"] = [100 + i]
            yield event({"choices": [choice]})
            if action == "break":
                return
            if action == "bad_utf8":
                yield b"data: {\"choices\": [{\"text\": \"\xff\xfe\"}]}\n\n"
                return
            if action == "stream_error":
                yield event({"error": {"message": "engine died", "code": 500}})
                return
        if self.behaviour.report_usage and body.get("stream_options", {}).get("include_usage"):
            yield event({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
