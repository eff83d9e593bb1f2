"""Streaming OpenAI-API client of the load generator (aiohttp, Server-Sent Events).

`yuebing.bench.runner` opens one `open_session`, calls `check_endpoint` once before any load
(unreachable, not an OpenAI server, unknown model → `InputError`), then `send` per request.
`send` streams ``/v1/completions`` or ``/v1/chat/completions``, timestamps each SSE event with
output, reads ``usage`` from the final chunk, judges the stream (`StreamReader`) and returns a
`RequestResult`; a failure is the result's ``error``, never an exception. A 429 is a rejection
unless ``--retry-429``, which waits ``Retry-After`` and resends within the request's timeout.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from yuebing.bench.config import BenchConfig
from yuebing.bench.result import RequestResult, Status
from yuebing.bench.workload import BenchRequest
from yuebing.core import env
from yuebing.core.errors import InputError

log = logging.getLogger(__name__)
_DECODE = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder()
DEFAULT_RETRY_AFTER_S = 1.0
"""Wait before resending a 429 that names no Retry-After."""
CHECK_TIMEOUT_S = 10.0
"""How long `check_endpoint` waits for ``/v1/models``."""


class SSEParser:
    """Incremental Server-Sent Events parser: `feed` one line, get an event's data when a
    blank line completes it (several ``data:`` lines join with ``\\n``; comments, ``event:``,
    ``id:`` and ``retry:`` fields are skipped)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: bytes) -> str | None:
        line = line.rstrip(b"\r\n")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value[1:].decode() if value.startswith(b" ") else value.decode())
        return None

    def flush(self) -> str | None:
        """The data of an event the stream ended without a blank line after, if any."""
        return self.feed(b"")


def open_session(cfg: BenchConfig) -> aiohttp.ClientSession:
    """A session without a connection cap (open-loop load must not queue in the client),
    sending JSON and, with ``--api-key-env NAME``, ``Authorization: Bearer $NAME``."""
    headers = {"Content-Type": "application/json"}
    if cfg.api_key_env:
        key = env.get(cfg.api_key_env)
        if not key:
            raise InputError(f"--api-key-env {cfg.api_key_env}: that environment variable is "
                             "not set")
        headers["Authorization"] = f"Bearer {key}"
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                 read_bufsize=1 << 20, timeout=aiohttp.ClientTimeout(total=None))


async def check_endpoint(session: aiohttp.ClientSession, cfg: BenchConfig) -> str:
    """The model to request: ``cfg.model`` if the endpoint lists it, else its first model."""
    url = cfg.base_url + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)) as r:
            if r.status in (401, 403):
                raise InputError(f"{url} answered HTTP {r.status} (not authorized): give the "
                                 "endpoint's token with --api-key-env NAME")
            if r.status != 200:
                raise InputError(f"{url} answered HTTP {r.status}; is --endpoint an "
                                 "OpenAI-compatible server?")
            body = _DECODE.decode(await r.read())
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise InputError(f"cannot reach --endpoint {cfg.endpoint}: "
                         f"{str(e) or type(e).__name__}") from None
    except msgspec.DecodeError:
        raise InputError(f"{url} did not answer JSON; is --endpoint an OpenAI-compatible "
                         "server?") from None
    try:
        models = [str(m["id"]) for m in body["data"]]
    except (KeyError, TypeError):
        raise InputError(f"{url} answered no model list ({{'data': [{{'id': ...}}]}})") from None
    if cfg.model:
        if cfg.model not in models:
            raise InputError(f"the endpoint serves {', '.join(models) or 'no model'}, not "
                             f"--model {cfg.model!r}")
        return cfg.model
    if not models:
        raise InputError(f"{url} lists no model to request")
    return models[0]


def request_body(req: BenchRequest, cfg: BenchConfig, model: str) -> dict[str, Any]:
    """The JSON body of ``req`` for ``cfg.api`` (always streaming, greedy, usage included)."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def retry_after_s(value: str | None, now: float | None = None) -> float:
    """Seconds to wait from a ``Retry-After`` header (delta seconds or an HTTP date)."""
    if not value:
        return DEFAULT_RETRY_AFTER_S
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER_S
    return max(0.0, when - (time.time() if now is None else now))


def _output_text(choice: dict[str, Any], api: str) -> str:
    if api == "chat":
        delta = choice.get("delta") or {}
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


def _is_output_choice(choice: dict[str, Any], api: str) -> bool:
    """A choice that stands for generated output even when its text is empty (a model
    without a tokenizer streams one empty-text event per token); not chat's role chunk."""
    if api == "chat":
        return "role" not in (choice.get("delta") or {})
    return "text" in choice


def _take_usage(usage: dict[str, Any], res: RequestResult) -> None:
    res.output_tokens = int(usage.get("completion_tokens") or res.output_tokens)
    if usage.get("prompt_tokens") is not None:
        res.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = int(details["cached_tokens"])


class StreamReader:
    """One response stream's events into its `RequestResult`: `event` per SSE event's data,
    `end` once the stream is over. Called by `_read_stream` (and the unit tests).

    An event whose choices carry text or ``token_ids`` is an output event (timestamped in
    ``res.token_times_s``). Success is judged from the stream's completion and the token
    count — ``usage.completion_tokens``, else the ``token_ids`` streamed, else the output
    events — never from the text alone: when no event carried text or ids but the usage
    counts tokens (a model without a tokenizer, asked without ``return_token_ids``), the
    events that carried an output choice give the token times."""

    __slots__ = ("res", "api", "ids", "blank_s")

    def __init__(self, res: RequestResult, api: str) -> None:
        self.res, self.api = res, api
        self.ids = 0
        """Token ids streamed in the choices' ``token_ids``."""
        self.blank_s: list[float] = []
        """Times of the events with an output choice but neither text nor ids."""

    def event(self, data: str, now: float) -> bool:
        """Handle one SSE event; False when the stream reported an error (recorded)."""
        res = self.res
        try:
            obj = _DECODE.decode(data)
        except msgspec.DecodeError:
            res.fail(Status.ERROR, "bad_response", f"not JSON: {data[:80]!r}")
            return False
        if not isinstance(obj, dict):
            res.fail(Status.ERROR, "bad_response", f"not a JSON object: {data[:80]!r}")
            return False
        if obj.get("error") or obj.get("object") == "error":  # {"error": {...}} or vLLM's
            res.fail(Status.ERROR, "stream_error", str(obj.get("error") or obj.get("message")))
            return False
        output = blank = False
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                continue
            ids = c.get("token_ids")
            n_ids = len(ids) if isinstance(ids, list) else 0
            self.ids += n_ids
            if n_ids or _output_text(c, self.api):
                output = True
            elif _is_output_choice(c, self.api):
                blank = True
        if output:
            res.token_times_s.append(now)
        elif blank:
            self.blank_s.append(now)
        if obj.get("usage"):
            _take_usage(obj["usage"], res)
        return True

    def end(self, done: bool) -> None:
        """The stream is over (``done``: it ended with ``[DONE]``): judge it."""
        res = self.res
        if not done:
            res.fail(Status.ERROR, "incomplete", "the stream ended before [DONE]")
            return
        tokens = res.output_tokens or self.ids or len(res.token_times_s)
        if tokens and not res.token_times_s:
            res.token_times_s = self.blank_s
        if not (tokens and res.token_times_s):
            res.fail(Status.ERROR, "no_tokens", "the stream carried no output tokens")
            return
        res.status = Status.OK
        res.output_tokens = tokens


async def _read_stream(resp: aiohttp.ClientResponse, res: RequestResult, api: str,
                       clock: Callable[[], float]) -> None:
    parser, reader = SSEParser(), StreamReader(res, api)
    async for line in resp.content:
        data = parser.feed(line)
        if data is None:
            continue
        if data == "[DONE]":
            reader.end(True)
            return
        if not reader.event(data, clock()):
            return
    tail = parser.flush()
    if tail is not None and tail != "[DONE]" and not reader.event(tail, clock()):
        return
    reader.end(tail == "[DONE]")


async def _attempts(session: aiohttp.ClientSession, url: str, data: bytes, res: RequestResult,
                    cfg: BenchConfig, clock: Callable[[], float]) -> None:
    deadline = res.start_s + cfg.timeout_s
    while True:
        timeout = aiohttp.ClientTimeout(total=max(deadline - clock(), 1e-3))
        async with session.post(url, data=data, timeout=timeout) as resp:
            res.http_status = resp.status
            if resp.status == 200:
                if resp.content_type != "text/event-stream":
                    res.fail(Status.ERROR, "bad_response",
                             f"expected text/event-stream, got {resp.content_type}")
                    return
                await _read_stream(resp, res, cfg.api, clock)
                return
            text = (await resp.read())[:200].decode(errors="replace")
            wait = retry_after_s(resp.headers.get("Retry-After"))
        if resp.status != 429:
            res.fail(Status.ERROR, f"http_{resp.status}", text)
            return
        if not (cfg.retry_429 and clock() + wait < deadline):
            res.fail(Status.REJECTED, "rejected", text)
            return
        res.retries += 1
        await asyncio.sleep(wait)  # the refused response is released while waiting


async def send(session: aiohttp.ClientSession, req: BenchRequest, cfg: BenchConfig,
               model: str, clock: Callable[[], float]) -> RequestResult:
    """Send ``req`` now and stream its answer; the finished result (never raises for the
    request's own failure)."""
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    res = RequestResult(req.index, req.send_s, req.input_tokens, req.max_tokens)
    data = _ENCODE.encode(request_body(req, cfg, model))
    res.start_s = clock()
    try:
        await _attempts(session, cfg.base_url + path, data, res, cfg, clock)
    except TimeoutError:
        res.fail(Status.ERROR, "timeout", f"no complete answer within {cfg.timeout_s:g} s")
    except (aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
        res.fail(Status.ERROR, "connect", str(e))
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
        res.fail(Status.ERROR, "incomplete", str(e) or type(e).__name__)
    except (aiohttp.ClientError, OSError) as e:
        res.fail(Status.ERROR, "connect", str(e) or type(e).__name__)
    except ValueError as e:  # a line past the read buffer, bytes that are not UTF-8
        res.fail(Status.ERROR, "bad_response", f"{type(e).__name__}: {e}")
    res.finish(clock())
    log.debug("request %d: %s %s", req.index, res.status, res.error)
    return res
