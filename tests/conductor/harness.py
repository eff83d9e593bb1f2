"""Test harness: a Conductor app served by uvicorn in a thread on 127.0.0.1, plus a tiny HTTP
client (stdlib) for JSON and SSE, so tests talk to it over real sockets."""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import threading
import time
from typing import Any

import uvicorn

from yuebing.conductor.config import ConductorConfig
from yuebing.conductor.model import load_model_info
from yuebing.conductor.policy import PolicyConfig
from yuebing.conductor.server import create_app
from yuebing.conductor.service import Conductor

MODEL = "dummy:preset=tiny"
_POLICY_FIELDS = {f.name for f in dataclasses.fields(PolicyConfig)}


class ConductorThread:
    """`Conductor` + uvicorn in a daemon thread; ``url`` once started; `stop` to end."""

    def __init__(self, **cfg: Any) -> None:
        cfg.setdefault("model", MODEL)
        cfg.setdefault("access_log", False)
        policy = {k: cfg.pop(k) for k in list(cfg) if k in _POLICY_FIELDS}
        cfg["policy"] = PolicyConfig(block_tokens=cfg.get("store_block_tokens", 256), **policy)
        self.cfg = ConductorConfig(**cfg)
        self.conductor = Conductor(self.cfg, load_model_info(self.cfg.model))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.conductor), lifespan="on",
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        end = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < end, "conductor did not start"
            time.sleep(0.01)

    def wait_ready(self, timeout_s: float = 10.0, roles: tuple[str, ...] = ()) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            status, body = request(self.url, "GET", "/health")
            if body["ready"] and all(body["instances"][r] for r in roles):
                return body
            assert time.monotonic() < end, f"not ready: {body}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def request(url: str, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None, timeout_s: float = 30.0
            ) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request; ``body`` bytes are sent as they are."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"content-type": "application/json",
                                                    **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode(errors="replace")


def response(url: str, path: str, body: Any, headers: dict[str, str] | None = None,
             timeout_s: float = 30.0) -> tuple[http.client.HTTPConnection,
                                              http.client.HTTPResponse]:
    """An open response (for headers, or to read an SSE stream line by line)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"content-type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def sse_events(resp: http.client.HTTPResponse) -> list[Any]:
    """Every ``data:`` payload of an SSE response (JSON decoded; ``[DONE]`` as a string)."""
    out: list[Any] = []
    for line in resp.read().decode().splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def replace_cfg(cfg: ConductorConfig, **kw: Any) -> ConductorConfig:
    return dataclasses.replace(cfg, **kw)
