"""The admin HTTP endpoint every service exposes: ``GET /health``, ``GET /metrics`` (Prometheus
text) and JSON routes of the service's own (the store master's ``/keys``).

The store master and node and the instances start an `AdminServer` (``--admin-port``); the
Conductor serves both paths in its own app with `exposition` from here. A service describes its
state as data (`families`: levels → gauges, event counts → ``_total`` counters) in a
`FunctionCollector` read at scrape time, on a registry of its own (`new_registry`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from yuebing.core.errors import ConfigError

log = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content type of the Prometheus text exposition."""

JsonRoute = Callable[[dict[str, str]], Any]
"""An extra GET route: query parameters (last value of each) → a JSON-able body."""


def new_registry() -> CollectorRegistry:
    """A registry of one service (never the process-global one: several services of one
    process, as in tests, must not share metrics)."""
    return CollectorRegistry(auto_describe=False)


def exposition(registry: CollectorRegistry) -> bytes:
    """The Prometheus text of ``registry``."""
    return generate_latest(registry)


class FunctionCollector:
    """A collector whose metrics ``fn`` builds at each scrape (from the service's state)."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterator[Metric]:
        yield from self.fn()


def families(prefix: str, gauges: Mapping[str, float] = {},  # noqa: B006 - read only
             counters: Mapping[str, float] = {},  # noqa: B006
             docs: Mapping[str, str] = {}) -> Iterator[Metric]:  # noqa: B006
    """Gauges ``<prefix>_<name>`` (levels: objects, bytes used) and counters
    ``<prefix>_<name>_total`` (events since start); ``docs`` holds help texts by name."""
    for name, v in gauges.items():
        yield GaugeMetricFamily(f"{prefix}_{name}", docs.get(name, name.replace("_", " ")),
                                value=float(v))
    for name, v in counters.items():
        yield CounterMetricFamily(f"{prefix}_{name}", docs.get(name, name.replace("_", " ")),
                                  value=float(v))


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port < 65536:
        raise ConfigError(f"--admin-port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=64)
    except OSError as e:
        raise ConfigError(f"admin HTTP cannot bind {host}:{port} ({e}); pick another "
                          "--admin-port or --admin-host") from e


def _query(request: Request) -> dict[str, str]:
    raw = request.url.query
    try:
        parsed = parse_qs(raw, strict_parsing=bool(raw), max_num_fields=100)
    except ValueError as e:
        raise ValueError(f"bad query string {raw!r}: {e}") from e
    return {k: v[-1] for k, v in parsed.items()}


def build_app(health: Callable[[], Mapping[str, Any]], registry: CollectorRegistry,
              routes: Mapping[str, JsonRoute] | None = None) -> Starlette:
    """The admin app (see the module docstring); `AdminServer` serves it."""

    def health_endpoint(request: Request) -> Response:
        body = dict(health())
        return JSONResponse(body, status_code=200 if body.get("ok", True) else 503)

    def metrics_endpoint(request: Request) -> Response:
        return Response(exposition(registry), media_type=METRICS_CONTENT_TYPE)

    def json_endpoint(fn: JsonRoute) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            try:
                return JSONResponse(fn(_query(request)))
            except ValueError as e:
                return JSONResponse({"error": str(e)}, status_code=400)
        return endpoint

    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": "unknown path"}, status_code=404)

    table = [Route("/health", health_endpoint, methods=["GET"]),
             Route("/metrics", metrics_endpoint, methods=["GET"])]
    table += [Route(path, json_endpoint(fn), methods=["GET"])
              for path, fn in (routes or {}).items()]
    return Starlette(routes=table, exception_handlers={404: not_found})


class AdminServer:
    """``/health``, ``/metrics`` and ``routes`` of one service on ``host:port`` (port 0 =
    pick one), served from a daemon thread between `start` and `close`.

    The socket is bound in the constructor (a taken port fails at start; port 0 picks one:
    `.port`); a small Starlette app is served by uvicorn on a daemon thread, so a service's main loop
    never runs HTTP. Handlers run in uvicorn's thread pool and may take the service's lock; one
    raising `ValueError` answers 400 ``{"error": ...}``, an unknown path 404; ``/health`` answers
    200 with the health function's JSON, 503 when it says ``"ok": false``."""

    def __init__(self, host: str, port: int, health: Callable[[], Mapping[str, Any]],
                 registry: CollectorRegistry, routes: Mapping[str, JsonRoute] | None = None,
                 name: str = "admin") -> None:
        self.host = host
        self.sock = _bind(host, port)
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(build_app(health, registry, routes), log_config=None,
                                log_level="warning", access_log=False, lifespan="off",
                                loop="asyncio", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except Exception:  # noqa: BLE001 - the service keeps running without its admin HTTP
            log.exception("admin HTTP on %s stopped", self.url)

    def start(self) -> AdminServer:
        self.thread.start()
        log.info("admin HTTP on %s (/health /metrics)", self.url)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=5.0)
        self.sock.close()

