"""The Conductor's HTTP server: OpenAI-compatible routes on Starlette + uvicorn.

`create_app(conductor)` builds the ASGI app; `run_conductor(cfg)` builds the `Conductor` and
serves it (called by ``yuebing serve conductor``). Routes: ``POST /v1/completions``,
``POST /v1/chat/completions`` (SSE when ``stream``), ``GET /v1/models``, ``GET /health``
(``?ready=1``: 503 until a request could be routed), ``GET /metrics``, ``GET /predictors``.
A generation request (`_Routes._generate`) waits for its first delta before answering, so a
rejection is still a plain 429/503 response. Every error body is OpenAI's; every request ends
in one access log line and the histograms.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from yuebing.conductor.api import ApiError, GenRequest, decode_body, parse_request
from yuebing.conductor.config import ConductorConfig
from yuebing.conductor.delta import Delta
from yuebing.conductor.dispatch import Rejected, RequestFailed
from yuebing.conductor.policy import RejectReason
from yuebing.conductor.push import Pusher, SseResponse
from yuebing.conductor.render import DONE, Choices, Renderer, error_event
from yuebing.conductor.service import Conductor, build_conductor
from yuebing.conductor.stats import RequestStats
from yuebing.core.errors import ConfigError
from yuebing.ops.admin import METRICS_CONTENT_TYPE

log = logging.getLogger(__name__)
access = logging.getLogger("yuebing.conductor.access")
T = TypeVar("T")


class _Disconnected(Exception):
    pass


def create_app(conductor: Conductor) -> Starlette:
    """The ASGI app of ``conductor`` (its lifespan starts and stops the conductor's tasks).
    Plain Starlette: the handlers take the raw request (validation is `yuebing.conductor.api`'s)
    and no framework middleware sits on the per-token send path."""
    routes = _Routes(conductor)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return _error_response(ApiError(exc.status_code, str(exc.detail),
                                        code="not_found" if exc.status_code == 404 else None))

    return Starlette(
        routes=[Route("/v1/completions", routes.completions, methods=["POST"]),
                Route("/v1/chat/completions", routes.chat, methods=["POST"]),
                Route("/v1/models", routes.models, methods=["GET"]),
                Route("/health", routes.health, methods=["GET"]),
                Route("/metrics", routes.metrics, methods=["GET"]),
                Route("/predictors", routes.predictors, methods=["GET"])],
        exception_handlers={ApiError: api_error, StarletteHTTPException: http_error},
        lifespan=conductor.lifespan)


def _error_response(e: ApiError) -> Response:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Routes:
    def __init__(self, c: Conductor) -> None:
        self.c = c

    async def models(self, request: Request) -> Response:
        self._auth(request)
        c = self.c
        return JSONResponse({"object": "list", "data": [{
            "id": c.cfg.model_name, "object": "model", "created": c.started,
            "owned_by": "yuebing", "max_model_len": c.max_model_len()}]})

    async def health(self, request: Request) -> Response:
        body = self.c.health()
        ready = request.query_params.get("ready") in ("1", "true")
        return JSONResponse(body, status_code=503 if ready and not body["ready"] else 200)

    async def metrics(self, request: Request) -> Response:
        return Response(self.c.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    async def predictors(self, request: Request) -> Response:
        """The predictors the policy uses now, as a predictor file (``--predictors``, the
        simulator's ``--profile``)."""
        return Response(self.c.policy.predictors.to_json(), media_type="application/json")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    def _auth(self, request: Request) -> None:
        key = self.c.cfg.api_key
        got = request.headers.get("authorization", "").encode()
        if key and not hmac.compare_digest(got, f"Bearer {key}".encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        limit = self.c.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes",
                           code="request_too_large")
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes",
                               code="request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    async def _generate(self, request: Request, chat: bool) -> Response:
        """Authenticate (optional Bearer key), read the body under the size limit, validate and
        tokenize (`yuebing.conductor.api`), take ``max_concurrent`` slots, start
        `Dispatcher.generate` and wait for its first delta while watching for a client
        disconnect, then stream (or collect) the rest."""
        arrival = time.perf_counter()
        c = self.c
        self._auth(request)
        raw = await self._body(request)
        body_s = time.perf_counter()
        req = parse_request(decode_body(raw), chat, c.model.tokenizer, c.limits())
        parsed_s = time.perf_counter()
        parts = req.each_prompt()  # each prompt of a list takes a slot of max_concurrent
        if len(parts) > c.cfg.max_concurrent:
            raise ApiError(400, f"{len(parts)} prompts in one request exceed the "
                           f"{c.cfg.max_concurrent} requests this server runs at once",
                           param="prompt")
        if c.inflight + len(parts) > c.cfg.max_concurrent:
            c.metrics.rejected_requests.labels("too_many_requests").inc()
            raise ApiError(429, f"more than {c.cfg.max_concurrent} requests in flight; retry",
                           type="server_overloaded", code="too_many_requests",
                           headers={"Retry-After": "1"})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{c.id_prefix}{next(c.ids):x}"
        stats = [RequestStats(rid if len(parts) == 1 else f"{rid}-p{i}", arrival,
                              body_s=body_s, parsed_s=parsed_s) for i in range(len(parts))]
        c.inflight += len(parts)
        c.metrics.running.inc(len(parts))
        handed_over = False
        renderer = Renderer(req.chat, c.cfg.model_name, rid, req.include_usage and req.stream,
                            req.return_token_ids, req.sampling.logprobs is not None, c.tokens)
        pusher = Pusher(renderer.chunk, c.metrics.relay.observe) if req.stream else None
        if len(parts) == 1:
            gen = c.dispatcher.generate(req, stats[0], pusher)
        else:  # each prompt routed on its own; choice i * n + j is prompt i's j-th
            gen = _merge([c.dispatcher.generate(p, s, None) for p, s in zip(parts, stats,
                                                                            strict=True)],
                         req.n)
        try:
            if pusher is not None:
                first = await _race(_first(gen), request.receive)
                handed_over = True
                return SseResponse(self._sse(gen, first, req, stats, renderer, pusher), pusher,
                                   headers={"Cache-Control": "no-cache"})
            choices = await _race(_collect(gen), request.receive)
            self._done(stats, 200)
            return Response(renderer.full(choices, stats), media_type="application/json")
        except Rejected as e:
            err = _rejection(e)
            self._done(stats, err.status, e.reason)  # the access log names why
            raise err from None
        except RequestFailed as e:
            self._done(stats, 500, e.code)
            raise ApiError(500, str(e), type="server_error", code=e.code) from None
        except _Disconnected:
            self._done(stats, 499, "client_disconnected")
            return Response(status_code=499)
        finally:
            if not handed_over:
                self._release(len(parts))
                if len(parts) > 1:
                    c.cluster.spawn(_close(gen))

    async def _sse(self, gen: AsyncIterator[Delta], first: Delta | None, req: GenRequest,
                   stats: list[RequestStats], r: Renderer,
                   pusher: Pusher) -> AsyncIterator[bytes]:
        """The body of a streamed response: what ``gen`` yields (the first token, the end,
        anything that found earlier events queued); plain tokens in between are written by
        ``pusher`` while this waits (`yuebing.conductor.push`)."""
        c = self.c
        status, code = 499, "client_disconnected"
        try:
            if req.chat:
                for index in range(req.n):
                    yield r.role_chunk(index)
            relay = c.metrics.relay.observe
            if first is not None:
                yield pusher.render(first)
                relay(time.perf_counter() - first.received_s)
            try:
                pusher.waiting = True
                async for d in gen:
                    await pusher.hold()
                    yield pusher.render(d)
                    relay(time.perf_counter() - d.received_s)
                    pusher.waiting = True
                await pusher.hold()
            except RequestFailed as e:
                await pusher.hold()
                status, code = 500, e.code
                yield error_event(str(e), e.code)
                yield DONE
                return
            if req.include_usage:
                yield r.usage_chunk(stats)
            yield DONE
            status, code = 200, ""
        finally:
            pusher.close()
            c.cluster.spawn(_close(gen))
            self._done(stats, status, code)
            self._release(len(stats))

    def _release(self, slots: int) -> None:
        self.c.inflight -= slots
        self.c.metrics.running.dec(slots)

    def _done(self, stats: list[RequestStats], status: int, code: str = "") -> None:
        for s in stats:
            if code and not s.error_code:
                s.error_code = code
            if status == 200 or s.dispatched_s is not None:
                self.c.metrics.finished(s)
            if status == 200 and s.breakdown.prefill_s > 0 and not s.pipelined:
                threads = s.breakdown.prefill_threads  # what it ran with, else what was routed
                factor = self.c.calibration.prefill_factor(threads, s.prefill_id) if threads > 0 \
                    else s.prefill_factor
                self.c.calibration.observe(s.prompt_tokens - s.cached_tokens, s.cached_tokens,
                                           s.breakdown.prefill_s, factor)
            if status == 200 and s.completion_tokens > 1:
                self.c.durations.observe(s.e2e_s - s.ttft_s)
                if s.prefill_busy and len(s.token_times) > 2:  # the tail applies to such
                    # requests only (`Policy.tbt`); per the step of the batch it decoded in,
                    # from its second token (the first is the prefill's, before it joined)
                    step = self.c.steps.mean_step(s.decode_id, s.token_times[1],
                                                  s.token_times[-1])
                    if step is not None:
                        self.c.tail.observe(s.tbt_s, step)
            if status == 200:
                self.c.learned.note()
            if self.c.cfg.access_log:
                access.info("%s", s.log_line(status))


async def _first(gen: AsyncIterator[Delta]) -> Delta | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def _collect(gen: AsyncIterator[Delta]) -> Choices:
    choices = Choices()
    async for d in gen:
        choices.add(d)
    return choices


async def _merge(gens: list[AsyncIterator[Delta]], n: int) -> AsyncIterator[Delta]:
    """The deltas of a prompt list's requests (one per prompt, each dispatched on its own) as
    they come, prompt ``i``'s choice ``j`` renumbered ``i * n + j``. The first failure ends
    it (a rejection after deltas went out becomes `RequestFailed`); closing it cancels the
    requests still running."""
    q: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[Delta]) -> None:
        try:
            async for d in gen:
                q.put_nowait((i, d, None))
            q.put_nowait((i, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            q.put_nowait((i, None, e))
        finally:
            await _close(gen)

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    sent = False
    try:
        left = len(gens)
        while left:
            i, d, err = await q.get()
            if err is not None:
                if sent and isinstance(err, Rejected):
                    raise RequestFailed(err.reason, str(err)) from None
                raise err
            if d is None:
                left -= 1
                continue
            sent = True
            yield replace(d, index=i * n + d.index)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(gen: AsyncIterator[Delta]) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


async def _race(work: Coroutine[Any, Any, T], receive: Receive) -> T:
    """``await work`` in this task, or raise `_Disconnected` (cancelling it) when the client
    goes away (a watch task cancels this one)."""
    task = asyncio.current_task()
    assert task is not None
    watching = [True]

    def gone(w: asyncio.Future[None]) -> None:
        if w.cancelled():
            return
        w.exception()  # retrieved (also when it failed after the race): a failed receive
        if watching[0]:  # counts as a disconnect
            task.cancel()

    watch = asyncio.ensure_future(_disconnected(receive))
    watch.add_done_callback(gone)
    try:
        return await work
    except asyncio.CancelledError:
        if watch.done() and not watch.cancelled() and task.uncancel() == 0:
            raise _Disconnected from None
        raise
    finally:
        watching[0] = False
        watch.cancel()


async def _disconnected(receive: Receive) -> None:
    while True:
        message: dict[str, Any] = await receive()  # type: ignore[assignment]
        if message["type"] == "http.disconnect":
            return


def _rejection(e: Rejected) -> ApiError:
    if math.isinf(e.retry_after_s):
        return ApiError(400, str(e), code=e.reason)
    retry = str(max(1, math.ceil(e.retry_after_s)))
    status = 503 if e.reason == RejectReason.NO_INSTANCES else 429
    return ApiError(status, str(e), type="server_overloaded", code=e.reason,
                    headers={"Retry-After": retry})


def run_conductor(cfg: ConductorConfig, ready_file: str = "") -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code. With ``ready_file``, ``{"url": ...}``
    is written there (atomically) once the socket listens (useful with ``port=0``)."""
    import socket

    import uvicorn

    conductor = build_conductor(cfg)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror}") from None
    sock.listen(1024)
    host = f"[{cfg.host}]" if family == socket.AF_INET6 else cfg.host
    conductor.url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(conductor), log_level="warning",
                                           access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=5))
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"url": conductor.url, "pid": os.getpid()}, f)
        os.replace(tmp, ready_file)
    print(f"conductor serving {cfg.model_name} on {conductor.url}", flush=True)
    gc.freeze()  # start-up's objects (tokenizer, modules) out of every later collection
    conductor.metrics.watch_gc()
    try:
        server.run(sockets=[sock])
    finally:
        conductor.metrics.unwatch_gc()
    return 0
