"""Admin HTTP of the master (127.0.0.1 only) with Prometheus metrics.

Endpoints: ``/health`` (role and leader), ``/keys?prefix=P&limit=N`` (committed keys),
``/segments`` (per segment: tier, node, capacity, used, state), ``/usage`` (the core's usage and
counters) and ``/metrics`` (Prometheus text). Served from its own thread; every read takes the
service lock for a consistent snapshot. Bad query strings get HTTP 400 and change nothing.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlparse

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from yuebing.store.master.service import MasterService

log = logging.getLogger(__name__)


class _Collector:
    def __init__(self, svc: MasterService) -> None:
        self.svc = svc

    def collect(self):
        with self.svc.lock:
            usage = self.svc.core.stats().values
            segs = [(s.name, s.tier, s.alloc.capacity if s.alloc else s.size,
                     s.alloc.used if s.alloc else 0) for s in self.svc.core.segs.values()]
        for k, v in usage.items():
            yield GaugeMetricFamily(f"yuebing_store_{k}", f"store master {k}", value=v)
        cap = GaugeMetricFamily("yuebing_store_segment_capacity_bytes", "segment capacity",
                                labels=["segment", "tier"])
        used = GaugeMetricFamily("yuebing_store_segment_used_bytes", "segment bytes allocated",
                                 labels=["segment", "tier"])
        for name, tier, c, u in segs:
            cap.add_metric([name, str(tier)], c)
            used.add_metric([name, str(tier)], u)
        yield cap
        yield used
        yield GaugeMetricFamily("yuebing_store_leader", "1 when this master leads",
                                value=1.0 if self.svc.leading else 0.0)


def _handler(svc: MasterService, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: object) -> None:
            log.debug(fmt, *args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            try:
                q = {k: v[-1] for k, v in parse_qs(url.query, strict_parsing=bool(url.query)).items()}
                body = self._route(url.path, q)
            except ValueError as e:
                self._send(400, json.dumps({"error": str(e)}).encode())
                return
            if body is None:
                self._send(404, b'{"error": "unknown path"}')
            elif isinstance(body, bytes):
                self._send(200, body, "text/plain; version=0.0.4")
            else:
                self._send(200, json.dumps(body).encode())

        def _route(self, path: str, q: dict[str, str]) -> object:
            if path == "/metrics":
                return generate_latest(registry)
            with svc.lock:
                core = svc.core
                if path == "/health":
                    return {"ok": True, "leader": svc.leading, "leader_address": svc.elector.leader(),
                            "objects": len(core.objs) - len(core.reservations)}
                if path == "/usage":
                    return core.stats().values
                if path == "/segments":
                    return [{"name": s.name, "tier": s.tier, "node": s.node, "size": s.size,
                             "used": s.alloc.used if s.alloc else None, "state": int(s.state)}
                            for s in core.segs.values()]
                if path == "/keys":
                    limit = int(q.get("limit", "1000"))
                    if limit < 0:
                        raise ValueError("limit must be >= 0")
                    prefix = q.get("prefix", "")
                    out: list[str] = []
                    for k, o in core.objs.items():
                        if len(out) >= limit:
                            break
                        if o.state == 1 and k.startswith(prefix):
                            out.append(k)
                    return out
            return None

    return Handler


class AdminServer:
    """Serves the admin HTTP endpoints of ``svc`` on 127.0.0.1:``port`` from a daemon thread."""

    def __init__(self, svc: MasterService, port: int) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(svc))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(svc, registry))
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="store-admin",
                                       daemon=True)

    def start(self) -> AdminServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
