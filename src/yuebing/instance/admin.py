"""Admin HTTP of a serving instance (`ops.admin.AdminServer`; ``yuebing serve
prefill|decode|coupled --admin-host/--admin-port``, 0 = off), started by `instance.run`.

``/health``: ``{"ok", "instance_id", "role", "control_address"}``, 503 until the control socket
is bound and once the instance is stopping. ``/metrics`` (`collect`), read from the admin thread
with plain length and counter reads (no iteration over state the engine thread changes):
gauges ``yuebing_instance_requests_{running,waiting}`` (engine batch and queue),
``yuebing_instance_tasks`` (control-plane tasks held), ``yuebing_instance_kv_blocks_{free,total}``,
``yuebing_instance_subscribers`` and ``yuebing_instance_info{role,instance_id,model}`` = 1;
counter ``yuebing_instance_preemptions_total``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, Metric

from yuebing.ops.admin import AdminServer, FunctionCollector, families, new_registry

if TYPE_CHECKING:
    from yuebing.instance.base import Instance


def collect(inst: Instance) -> Iterator[Metric]:
    """The instance's metrics at one instant (see the module docstring)."""
    sched, alloc = inst.engine.scheduler, inst.engine.allocator
    gauges = {"requests_running": len(sched.running), "requests_waiting": len(sched.waiting),
              "tasks": len(inst.tasks), "kv_blocks_free": alloc.num_free,
              "kv_blocks_total": alloc.num_blocks, "subscribers": len(inst.subscribers)}
    yield from families("yuebing_instance", gauges, {"preemptions": sched.num_preemptions})
    info = GaugeMetricFamily("yuebing_instance_info", "this instance (value 1)",
                             labels=["role", "instance_id", "model"])
    info.add_metric([inst.cfg.role, inst.instance_id, inst.engine.model_config.name], 1.0)
    yield info


def _health(inst: Instance) -> dict[str, Any]:
    return {"ok": bool(inst.control_address) and not inst._stopping,
            "instance_id": inst.instance_id, "role": inst.cfg.role,
            "control_address": inst.control_address}


def admin_server(inst: Instance) -> AdminServer:
    """The instance's admin HTTP on ``--admin-host:--admin-port`` (not started)."""
    registry = new_registry()
    registry.register(FunctionCollector(lambda: collect(inst)))
    return AdminServer(inst.cfg.admin_host, inst.cfg.admin_port, lambda: _health(inst),
                       registry, name="instance-admin")
