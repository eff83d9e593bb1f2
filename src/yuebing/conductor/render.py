"""OpenAI response bodies and SSE events for completions and chat completions.

Called by the HTTP routes (`yuebing.conductor.server`) as `Delta`s arrive: `Renderer.chunk`
per delta (``data: {...}\\n\\n``; each carries its choice's ``index``), `Renderer.usage_chunk`
at the end of a stream that asked for ``stream_options.include_usage``, `Renderer.full` for a
non-streamed response (the deltas gathered per choice in `Choices`). Logprobs are rendered in
OpenAI's shapes: chat ``logprobs.content[]`` of ``{token, logprob, bytes, top_logprobs[]}``,
completions ``{tokens, token_logprobs, top_logprobs, text_offset}``; token strings come from
`TokenText`. The usage carries ``prompt_tokens_details.cached_tokens`` and the ``yuebing``
extension (the request's timing breakdown, `RequestStats.extension`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from yuebing.conductor.delta import Delta
from yuebing.conductor.stats import RequestStats
from yuebing.engine.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"
_enc = msgspec.json.Encoder()


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


class TokenText:
    """A token id's string and UTF-8 bytes as logprobs show them (cached per id); without a
    tokenizer, ``token_id:N`` (vLLM's ``return_tokens_as_token_ids`` form)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            if self.tokenizer is None or not 0 <= token < self.tokenizer.vocab_size:
                text = f"token_id:{token}"
                raw = text.encode()
            else:
                raw = self.tokenizer.token_bytes(token)
                text = raw.decode("utf-8", errors="replace")
            hit = self._cache[token] = (text, list(raw))
        return hit


@dataclass
class Choice:
    """One choice of a non-streamed response, gathered from its deltas."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def add(self, d: Delta) -> None:
        self.parts.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None and d.top_ids is not None and d.top_logprobs is not None:
            self.logprobs.extend(d.logprobs)
            self.top_ids.extend(d.top_ids)
            self.top_logprobs.extend(d.top_logprobs)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason


class Choices(dict[int, Choice]):
    """The choices of a non-streamed response by index."""

    def add(self, d: Delta) -> None:
        c = self.get(d.index)
        if c is None:
            c = self[d.index] = Choice()
        c.add(d)


class Renderer:
    """Bodies of one response (``chat`` or text completion) for model ``model``."""

    __slots__ = ("chat", "model", "id", "created", "include_usage", "token_ids", "logprobs",
                 "tokens", "_object", "_offsets")

    def __init__(self, chat: bool, model: str, request_id: str, include_usage: bool,
                 token_ids: bool = False, logprobs: bool = False,
                 tokens: TokenText | None = None) -> None:
        self.chat = chat
        self.token_ids = token_ids
        """Add each choice's generated ``token_ids`` (vLLM's ``return_token_ids``)."""
        self.logprobs = logprobs
        """The request asked for logprobs (rendered from the deltas' values)."""
        self.tokens = tokens or TokenText(None)
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._offsets: dict[int, int] = {}
        """Streamed completions: each choice's text offset so far (``text_offset``)."""

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": self._object, "created": self.created,
                               "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def role_chunk(self, index: int = 0) -> bytes:
        return sse(self._envelope([{"index": index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]))

    def chunk(self, d: Delta) -> bytes:
        lp = self._logprobs(d.token_ids, d.logprobs, d.top_ids, d.top_logprobs, d.index) \
            if self.logprobs and d.token_ids else None
        if self.chat:
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            choice: dict[str, Any] = {"index": d.index, "delta": delta, "logprobs": lp,
                                      "finish_reason": d.finish_reason}
        else:
            choice = {"index": d.index, "text": d.text, "logprobs": lp,
                      "finish_reason": d.finish_reason}
        if self.token_ids:
            choice["token_ids"] = d.token_ids or []
        return sse(self._envelope([choice]))

    def usage_chunk(self, stats: list[RequestStats]) -> bytes:
        out = self._envelope([])
        out["usage"] = usage(stats)
        return sse(out)

    def full(self, choices: Choices, stats: list[RequestStats]) -> bytes:
        rendered = []
        for index in sorted(choices):
            c = choices[index]
            text = "".join(c.parts)
            lp = self._logprobs(c.token_ids, c.logprobs, c.top_ids, c.top_logprobs, index) \
                if self.logprobs else None
            if self.chat:
                choice: dict[str, Any] = {"index": index, "message": {"role": "assistant",
                                                                      "content": text},
                                          "logprobs": lp,
                                          "finish_reason": c.finish_reason or "stop"}
            else:
                choice = {"index": index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason or "stop"}
            if self.token_ids:
                choice["token_ids"] = c.token_ids
            rendered.append(choice)
        return _enc.encode({"id": self.id,
                            "object": "chat.completion" if self.chat else "text_completion",
                            "created": self.created, "model": self.model, "choices": rendered,
                            "usage": usage(stats)})

    def _logprobs(self, ids: list[int], chosen: list[float] | None,
                  top_ids: list[list[int]] | None, top_lps: list[list[float]] | None,
                  index: int) -> dict[str, Any] | None:
        """OpenAI's logprobs object of tokens ``ids`` of choice ``index`` (None when the
        instance sent no values for them)."""
        if chosen is None or top_ids is None or top_lps is None or len(chosen) != len(ids):
            return None
        tt = self.tokens.get
        if self.chat:
            content = []
            for t, lp, ti, tl in zip(ids, chosen, top_ids, top_lps, strict=True):
                text, raw = tt(t)
                content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": [
                    {"token": tt(a)[0], "logprob": b, "bytes": tt(a)[1]}
                    for a, b in zip(ti, tl, strict=True)]})
            return {"content": content, "refusal": None}
        offset = self._offsets.get(index, 0)
        tokens, offsets, tops = [], [], []
        for t, lp, ti, tl in zip(ids, chosen, top_ids, top_lps, strict=True):
            text = tt(t)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            top = {tt(a)[0]: b for a, b in zip(ti, tl, strict=True)}
            top.setdefault(text, lp)  # the sampled token too, as vLLM and OpenAI give it
            tops.append(top)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": list(chosen), "top_logprobs": tops,
                "text_offset": offsets}


def usage(stats: list[RequestStats]) -> dict[str, Any]:
    """The usage of a response whose prompts were dispatched as ``stats`` (one per prompt)."""
    prompt = sum(s.prompt_tokens for s in stats)
    completion = sum(s.completion_tokens for s in stats)
    ext = stats[0].extension() if len(stats) == 1 else {
        "prompts": [s.extension() for s in stats]}
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in stats)},
            "yuebing": ext}


def error_event(message: str, code: str, type: str = "server_error") -> bytes:
    return sse({"error": {"message": message, "type": type, "param": None, "code": code}})
