"""`ops.admin`: the health + metrics HTTP every service shares, and the store's metric types."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from yuebing.core.errors import ConfigError
from yuebing.ops.admin import AdminServer, FunctionCollector, families, new_registry


def get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["Content-Type"]


def types(text: bytes) -> dict[str, str]:
    """Metric name (as exposed, counters with _total) → its declared type."""
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[s.name] = fam.type
    return out


@pytest.fixture()
def server() -> Iterator[AdminServer]:
    state = {"ok": True, "events": 3}
    registry = new_registry()
    registry.register(FunctionCollector(lambda: families(
        "demo", {"used_bytes": 10}, {"events": state["events"]})))

    def echo(q: dict[str, str]) -> dict[str, int]:
        return {"n": int(q["n"])}  # a KeyError is a server bug, a ValueError the caller's

    s = AdminServer("127.0.0.1", 0, lambda: {"ok": state["ok"]}, registry, {"/echo": echo})
    s.state = state  # type: ignore[attr-defined]
    yield s.start()
    s.close()


def test_health_metrics_routes_and_errors(server: AdminServer) -> None:
    assert server.url.startswith("http://127.0.0.1:") and server.port > 0
    assert get(server.url + "/health")[:2] == (200, b'{"ok":true}')
    server.state["ok"] = False  # type: ignore[attr-defined]
    assert get(server.url + "/health")[0] == 503
    status, body, ctype = get(server.url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    t = types(body)
    assert t["demo_used_bytes"] == "gauge" and t["demo_events_total"] == "counter"
    assert b"demo_events_total 3.0" in body
    assert json.loads(get(server.url + "/echo?n=4")[1]) == {"n": 4}
    status, body, _ = get(server.url + "/echo?n=x")
    assert status == 400 and "invalid literal" in json.loads(body)["error"]
    status, body, _ = get(server.url + "/echo?=&&bad")
    assert status == 400 and "bad query string" in json.loads(body)["error"]
    assert get(server.url + "/nope") == (404, b'{"error":"unknown path"}', "application/json")


def test_taken_port_is_a_start_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"admin HTTP cannot bind 127.0.0.1:{port}"):
            AdminServer("127.0.0.1", port, dict, new_registry())


def test_store_master_counters_are_counters_and_levels_gauges() -> None:
    from yuebing.store.config import MasterConfig
    from yuebing.store.master import admin
    from yuebing.store.master.service import MasterService

    svc = MasterService(MasterConfig(rpc_address="tcp://127.0.0.1:0"))
    try:
        svc.core.counters["quarantined"] = 2
        s = admin.admin_server(svc, "127.0.0.1", 0).start()
        try:
            status, body, _ = get(s.url + "/metrics")
            usage = json.loads(get(s.url + "/usage")[1])
        finally:
            s.close()
    finally:
        svc.close()
    t = types(body)
    assert status == 200 and b"yuebing_store_quarantined_total 2.0" in body
    for name in ("quarantined", "puts", "gets", "evictions", "migrations_done"):
        assert t[f"yuebing_store_{name}_total"] == "counter", name
    for name in ("objects", "pending", "dram_used_bytes", "dram_capacity_bytes",
                 "quarantined_bytes", "leader"):
        assert t[f"yuebing_store_{name}"] == "gauge", name
    assert "yuebing_store_quarantined" not in t and "yuebing_store_dram_used" not in t
    assert usage["quarantined"] == 2 and "dram_used" in usage  # /usage JSON keeps its keys
