"""Admin HTTP of the master (`ops.admin.AdminServer`, ``--admin-host``/``--admin-port``).

Endpoints: ``/health`` (role and leader), ``/keys?prefix=P&limit=N`` (committed keys),
``/segments`` (per segment: tier, node, capacity, used, state), ``/usage`` (the core's usage and
counters, JSON) and ``/metrics`` (Prometheus text). Every read takes the service lock for a
consistent snapshot. Bad query strings get HTTP 400 and change nothing.

Metrics (`collect`): levels are gauges — ``yuebing_store_{objects,pending,reservations,
segments,sessions,tasks}``, ``yuebing_store_{dram,ssd}_{capacity,used}_bytes``,
``yuebing_store_quarantined_bytes``, per segment ``yuebing_store_segment_{capacity,used}_bytes``
and ``yuebing_store_leader``; the core's event counts are counters ``yuebing_store_<name>_total``
(``puts``, ``gets``, ``evictions``, ``quarantined``, ``migrations_done``, ...).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, Metric

from yuebing.ops.admin import AdminServer, FunctionCollector, families, new_registry

if TYPE_CHECKING:
    from yuebing.store.master.service import MasterService

_BYTES = {"dram_capacity", "dram_used", "ssd_capacity", "ssd_used"}
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
