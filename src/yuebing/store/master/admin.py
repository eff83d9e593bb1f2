"""Admin HTTP of the master (`ops.admin.AdminServer`, ``--admin-host``/``--admin-port``),
started by `MasterService`.

Endpoints: ``/health`` (role, leader), ``/keys?prefix=P&limit=N``, ``/segments``, ``/usage`` (JSON)
and ``/metrics`` (`collect`: levels as gauges — objects, segments, bytes per tier and segment,
quarantined bytes, leader —, the core's event counts as ``yuebing_store_<name>_total``). Every
read takes the service lock; a bad query string gets HTTP 400 and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, Metric

from yuebing.ops.admin import AdminServer, FunctionCollector, families, new_registry

if TYPE_CHECKING:
    from yuebing.store.master.service import MasterService

_BYTES = {"dram_capacity", "dram_used", "ssd_capacity", "ssd_used", "inline_capacity",
          "inline_used"}
"""Usage entries in bytes: exported with the ``_bytes`` unit suffix."""


def collect(svc: MasterService) -> Iterator[Metric]:
    """The master's metrics at one instant (see the module docstring)."""
    with svc.lock:
        usage = svc.core.stats().values
        counters = dict(svc.core.counters)
        segs = [(s.name, s.tier, s.alloc.capacity if s.alloc else s.size,
                 s.alloc.used if s.alloc else 0) for s in svc.core.segs.values()]
        leading = svc.leading
    gauges = {f"{k}_bytes" if k in _BYTES else k: v for k, v in usage.items()
              if k not in counters}
    yield from families("yuebing_store", gauges, counters)
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
                            value=1.0 if leading else 0.0)


def _keys(svc: MasterService, q: dict[str, str]) -> list[str]:
    try:
        limit = int(q.get("limit", "1000"))
    except ValueError:
        raise ValueError(f"limit must be an integer, got {q['limit']!r}") from None
    if limit < 0:
        raise ValueError("limit must be >= 0")
    prefix = q.get("prefix", "")
    out: list[str] = []
    with svc.lock:
        for k, o in svc.core.objs.items():
            if len(out) >= limit:
                break
            if o.state == 1 and k.startswith(prefix):
                out.append(k)
    return out


def _segments(svc: MasterService) -> list[dict[str, Any]]:
    with svc.lock:
        return [{"name": s.name, "tier": s.tier, "node": s.node, "size": s.size,
                 "used": s.alloc.used if s.alloc else None, "state": int(s.state)}
                for s in svc.core.segs.values()]


def _health(svc: MasterService) -> dict[str, Any]:
    with svc.lock:
        core = svc.core
        return {"ok": True, "leader": svc.leading, "leader_address": svc.elector.leader(),
                "objects": len(core.objs) - len(core.reservations)}


def _usage(svc: MasterService) -> dict[str, float]:
    with svc.lock:
        return svc.core.stats().values


def admin_server(svc: MasterService, host: str, port: int) -> AdminServer:
    """The master's admin HTTP on ``host:port`` (not started)."""
    registry = new_registry()
    registry.register(FunctionCollector(lambda: collect(svc)))
    routes = {"/usage": lambda q: _usage(svc), "/segments": lambda q: _segments(svc),
              "/keys": lambda q: _keys(svc, q)}
    return AdminServer(host, port, lambda: _health(svc), registry, routes, name="store-admin")
