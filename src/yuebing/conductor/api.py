"""OpenAI request bodies → a validated `GenRequest`, and OpenAI error bodies.

Called by the HTTP routes (`yuebing.conductor.server`) for every ``/v1/completions`` and
``/v1/chat/completions`` body, before anything is routed: the body is decoded, every field the
server understands is type- and range-checked, the prompt is tokenized (the chat template is
applied once, here) and checked against the context length. Anything wrong raises `ApiError`
with the HTTP status and OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body;
nothing has been sent to an instance at that point. No body makes it raise anything else: bytes
that are not UTF-8, nesting past `MAX_NESTING`, numbers out of range, wrong types at any level
are all 400s (duplicate keys: the last one wins, as in Python's ``json``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

import msgspec

from yuebing.core.errors import InputError
from yuebing.engine.tokenizer import Tokenizer
from yuebing.protocol.instance import Sampling

UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logit_bias",
               "response_format", "suffix", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "structured_outputs", "prediction", "audio")
"""Fields that change the output in ways this server cannot honour: refused (400 naming the
field) whenever they are set, never ignored."""
NEUTRAL = {"echo": False, "presence_penalty": 0, "frequency_penalty": 0,
           "repetition_penalty": 1}
"""Fields refused unless they hold the value that changes nothing."""
MAX_STOP = 16
MAX_NESTING = 64
"""Deepest JSON nesting accepted (an OpenAI body needs about 5; checked before decoding)."""
_STRING = re.compile(rb'"[^"\\]*+(?:\\(?:.|\Z)[^"\\]*+)*+(?:"|\Z)', re.S)
"""A string literal, or an unterminated one up to the end (possessive: linear time on any body,
escaped quotes included)."""
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_DEPTH = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request may ask for (from `ConductorConfig` and the instances' context)."""

    model_name: str
    max_model_len: int
    max_prompt_tokens: int
    max_tokens_cap: int
    max_n: int = 8
    max_logprobs: int = 20
    max_prompts: int = 64


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One validated generation request."""

    chat: bool
    prompt_ids: list[int]
    """The prompt this request dispatches (the first of ``prompts``)."""
    sampling: Sampling
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    """vLLM's extension: each choice also carries the generated ``token_ids``."""
    prompts: tuple[list[int], ...] = ()
    """Every prompt of a ``/v1/completions`` prompt list (each dispatched on its own; choice
    ``i * n + j`` is prompt ``i``'s ``j``-th sample); empty: just ``prompt_ids``."""

    @property
    def n(self) -> int:
        return self.sampling.n

    def each_prompt(self) -> list[GenRequest]:
        """One request per prompt of a prompt list (itself when it has one prompt)."""
        if len(self.prompts) <= 1:
            return [self]
        return [replace(self, prompt_ids=p, prompts=()) for p in self.prompts]


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object of ``body``; any other body is a 400 (never another exception)."""
    if _nesting(body) > MAX_NESTING:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_NESTING} levels",
                       code="invalid_json")
    try:
        obj = msgspec.json.decode(body)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    except (ValueError, RecursionError) as e:  # msgspec.DecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON ({e})",
                       code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(obj)}")
    try:  # msgspec keeps the last of duplicate keys; a body that names a field twice is refused
        json.loads(body, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ApiError(400, f"the request body names {str(e)!r} twice in one object",
                       code="invalid_json", param=str(e)) from None
    return obj


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _nesting(body: bytes) -> int:
    """How deep ``body``'s brackets nest outside string literals, without decoding it (C-level
    passes only: a body of a million ``[`` costs milliseconds); 0 when it cannot exceed
    `MAX_NESTING` by its bracket count alone."""
    if body.count(b"[") + body.count(b"{") <= MAX_NESTING:
        return 0
    brackets = _STRING.sub(b"", body).translate(_DEPTH, _BRACKETS)
    return max(accumulate(memoryview(brackets).cast("b")), default=0)


def parse_request(obj: dict[str, Any], chat: bool, tokenizer: Tokenizer | None,
                  limits: Limits) -> GenRequest:
    """Validate ``obj`` (a decoded body) and tokenize its prompt(s)."""
    model = obj.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required and must be a string", param="model")
    if model != limits.model_name:
        raise ApiError(400, f"the model '{model}' does not exist; this server serves "
                       f"'{limits.model_name}'", param="model", code="model_not_found")
    _refused(obj)
    n, logprobs = _choices(obj, chat, limits)
    prompts = [_chat_prompt(obj, tokenizer)] if chat else _completion_prompts(obj, tokenizer,
                                                                              limits)
    stream = _opt(obj, "stream", bool, False)
    options = _opt(obj, "stream_options", dict, None)
    if options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed with stream=true",
                       param="stream_options")
    include_usage = _opt(options or {}, "include_usage", bool, False, "stream_options.")
    longest = max(prompts, key=len)
    sampling = _sampling(obj, chat, len(longest), limits, n, logprobs)
    return GenRequest(chat, prompts[0], sampling, stream, include_usage,
                      _opt(obj, "return_token_ids", bool, False),
                      tuple(prompts) if len(prompts) > 1 else ())


def _refused(obj: dict[str, Any]) -> None:
    """A 400 naming the first field set that this server would have to ignore."""
    for name in UNSUPPORTED:
        if obj.get(name) is not None:
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    for name, neutral in NEUTRAL.items():
        v = obj.get(name)
        if v is None:
            continue
        same = v is neutral if isinstance(neutral, bool) else (
            isinstance(v, int | float) and not isinstance(v, bool) and v == neutral)
        if not same:
            raise ApiError(400, f"'{name}' is not supported by this server (only "
                           f"{str(neutral).lower()})", param=name)


def _choices(obj: dict[str, Any], chat: bool, limits: Limits) -> tuple[int, int | None]:
    """``n`` and the number of top logprobs per token (None: no logprobs) of a request."""
    n = _opt(obj, "n", int, 1)
    if not 1 <= n <= limits.max_n:
        raise ApiError(400, f"'n' must be in 1..{limits.max_n}, got {n}", param="n")
    best_of = _opt(obj, "best_of", int, None)
    if best_of is not None and best_of != n:
        raise ApiError(400, "'best_of' is not supported by this server (only best_of = n)",
                       param="best_of")
    most = limits.max_logprobs
    if chat:
        top = _opt(obj, "top_logprobs", int, None)
        if not _opt(obj, "logprobs", bool, False):
            if top is not None:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true",
                               param="top_logprobs")
            return n, None
        if not 0 <= (top or 0) <= most:
            raise ApiError(400, f"'top_logprobs' must be in 0..{most}, got {top}",
                           param="top_logprobs")
        return n, top or 0
    k = _opt(obj, "logprobs", int, None)
    if k is not None and not 0 <= k <= most:
        raise ApiError(400, f"'logprobs' must be in 0..{most}, got {k}", param="logprobs")
    return n, k


def _sampling(obj: dict[str, Any], chat: bool, prompt_len: int, limits: Limits, n: int = 1,
              logprobs: int | None = None) -> Sampling:
    if prompt_len > limits.max_prompt_tokens or prompt_len >= limits.max_model_len:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this server accepts at most "
                       f"{min(limits.max_prompt_tokens, limits.max_model_len - 1)}",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    room = limits.max_model_len - prompt_len
    name = "max_completion_tokens" if chat and obj.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _opt(obj, name, int, None)
    if max_tokens is None:
        max_tokens = min(limits.max_tokens_cap, room)
    elif max_tokens <= 0:
        raise ApiError(400, f"'{name}' must be at least 1, got {max_tokens}", param=name)
    elif max_tokens > limits.max_tokens_cap:
        raise ApiError(400, f"'{name}' is {max_tokens}; this server allows at most "
                       f"{limits.max_tokens_cap}", param=name)
    elif max_tokens > room:
        raise ApiError(400, f"the prompt ({prompt_len} tokens) plus {name}={max_tokens} exceeds "
                       f"the context length {limits.max_model_len}", param=name,
                       code="context_length_exceeded")
    temperature = _number(obj, "temperature", 1.0)
    top_p = _number(obj, "top_p", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"'temperature' must be in [0, 2], got {temperature}",
                       param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _opt(obj, "top_k", int, 0)
    if not -1 <= top_k < 2**31:
        raise ApiError(400, f"'top_k' must be in 0..2**31-1 (0 or -1: off), got {top_k}",
                       param="top_k")
    top_k = max(top_k, 0)
    seed = _opt(obj, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, f"'seed' must be in [0, 2**63), got {seed}", param="seed")
    min_tokens = _opt(obj, "min_tokens", int, 0)
    if not 0 <= min_tokens <= max_tokens:
        raise ApiError(400, f"'min_tokens' must be in 0..max_tokens, got {min_tokens}",
                       param="min_tokens")
    if seed is not None and seed + n > 2**63:
        raise ApiError(400, f"'seed' + n must be at most 2**63 (choice j samples with seed + j),"
                       f" got {seed} + {n}", param="seed")
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=seed, stop=_stop(obj), stop_token_ids=_int_list(obj, "stop_token_ids"),
                    ignore_eos=_opt(obj, "ignore_eos", bool, False), min_tokens=min_tokens,
                    n=n, logprobs=logprobs)


def _stop(obj: dict[str, Any]) -> list[str]:
    stop = obj.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"'stop' has {len(stop)} strings; at most {MAX_STOP}", param="stop")
    return stop


def _completion_prompts(obj: dict[str, Any], tokenizer: Tokenizer | None,
                        limits: Limits) -> list[list[int]]:
    """The token ids of each prompt: a string, a list of token ids, or a list of either."""
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        return [_one_prompt(prompt, tokenizer, "prompt")]
    single = _token_ids(prompt)
    if single is not None:
        return [_one_prompt(single, tokenizer, "prompt")]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "'prompt' is required: a string, a list of token ids, or a "
                       "non-empty list of either", param="prompt")
    if len(prompt) > limits.max_prompts:
        raise ApiError(400, f"'prompt' lists {len(prompt)} prompts; this server takes at most "
                       f"{limits.max_prompts} per request", param="prompt")
    return [_one_prompt(p, tokenizer, f"prompt[{i}]") for i, p in enumerate(prompt)]


def _one_prompt(prompt: object, tokenizer: Tokenizer | None, param: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, f"'{param}' must not be empty", param=param)
        return _encode(tokenizer, prompt)
    ids = prompt if isinstance(prompt, list) and prompt and all(map(_is_int, prompt)) \
        else _token_ids(prompt)
    if ids is None:
        raise ApiError(400, f"'{param}' must be a string or a non-empty list of token ids",
                       param=param)
    if min(ids) < 0:
        raise ApiError(400, f"'{param}' token ids must be >= 0", param=param)
    if max(ids) >= 2**31 or (tokenizer is not None and max(ids) >= tokenizer.vocab_size):
        most = tokenizer.vocab_size - 1 if tokenizer is not None else 2**31 - 1
        raise ApiError(400, f"'{param}' token ids must be in 0..{most}", param=param)
    return list(ids)


def _chat_prompt(obj: dict[str, Any], tokenizer: Tokenizer | None) -> list[int]:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty list",
                       param="messages")
    flat: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in ("system", "developer", "user",
                                                     "assistant"):
            raise ApiError(400, f"messages[{i}].role must be one of system, user, assistant",
                           param=f"messages[{i}].role")
        flat.append({"role": "system" if role == "developer" else role,
                     "content": _content(m.get("content"), i)})
    if tokenizer is None or not tokenizer.chat_template:
        raise ApiError(400, "this model has no chat template; use /v1/completions",
                       param="messages")
    try:
        return tokenizer.encode_chat(flat)
    except InputError as e:
        raise ApiError(400, str(e), param="messages") from None


def _content(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text"
                    and isinstance(p.get("text"), str)):
                raise ApiError(400, f"messages[{i}].content parts must be text parts "
                               "({\"type\": \"text\", \"text\": ...})",
                               param=f"messages[{i}].content")
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def _encode(tokenizer: Tokenizer | None, text: str) -> list[int]:
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer; send the prompt as a list of token ids",
                       param="prompt")
    return tokenizer.encode(text)


def _int_list(obj: dict[str, Any], name: str) -> list[int]:
    v = obj.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t < 2**31 for t in v):
        raise ApiError(400, f"'{name}' must be a list of token ids", param=name)
    return list(v)


def _token_ids(v: object) -> list[int] | None:
    """``v`` as a non-empty list of ints (not bools), else None (checked in C by msgspec)."""
    if not isinstance(v, list) or not v:
        return None
    try:
        return msgspec.convert(v, list[int])
    except msgspec.ValidationError:
        return None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt(obj: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any,
         prefix: str = "") -> Any:
    """``obj[name]`` checked against ``types`` (bools are not numbers), or ``default``."""
    v = obj.get(name)
    if v is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
        want = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in allowed)
        raise ApiError(400, f"'{prefix}{name}' must be {want}, got {_kind(v)}",
                       param=prefix + name)
    return v


def _number(obj: dict[str, Any], name: str, default: float) -> float:
    """``obj[name]`` as a float (an integer too large for one is out of range, not a crash)."""
    v = _opt(obj, name, (int, float), default)
    try:
        return float(v)
    except OverflowError:
        raise ApiError(400, f"'{name}' is out of range", param=name) from None


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
               dict: "an object", list: "a list"}


def _kind(v: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(v), "null" if v is None else "a value")
