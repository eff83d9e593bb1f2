"""Admin HTTP of a storage node (`ops.admin.AdminServer`, ``yuebing store node
--admin-host/--admin-port``): ``/health`` (name, segments, master) and ``/metrics``.

Metrics (`collect`), read without the node's loop (plain attribute reads): gauges
``yuebing_store_node_{dram,ssd}_bytes`` (contributed segment sizes),
``yuebing_store_node_tasks_queued``, ``yuebing_store_node_migrations_in_flight``,
``yuebing_store_node_transfer_endpoints``; counters ``yuebing_store_node_tasks_done_total``,
``yuebing_store_node_transfer_served_slices_total`` (slices its transfer engine served).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from yuebing.ops.admin import AdminServer, FunctionCollector, families, new_registry

if TYPE_CHECKING:
    from yuebing.store.node.service import StorageNode


def collect(node: StorageNode) -> Iterator[Metric]:
    """The node's metrics at one instant (see the module docstring)."""
    tx = node.engine.stats()
    gauges = {"dram_bytes": node.cfg.dram, "ssd_bytes": node._ssd_size if node.ssd_name else 0,
              "tasks_queued": len(node.tasks), "migrations_in_flight": len(node._moving),
              "transfer_endpoints": tx["endpoints"]}
    counters = {"tasks_done": node.tasks_done, "transfer_served_slices": tx["served_slices"]}
    yield from families("yuebing_store_node", gauges, counters)


def _health(node: StorageNode) -> dict[str, Any]:
    return {"ok": not node._stop.is_set(), "name": node.name, "dram": node.dram_name,
            "ssd": node.ssd_name, "master": node.conn.address}


def admin_server(node: StorageNode, host: str, port: int) -> AdminServer:
    """The node's admin HTTP on ``host:port`` (not started)."""
    registry = new_registry()
    registry.register(FunctionCollector(lambda: collect(node)))
    return AdminServer(host, port, lambda: _health(node), registry, name="node-admin")
