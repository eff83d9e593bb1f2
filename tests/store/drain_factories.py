"""Factories for the drain-migration tests of the master core (virtual clock, no sockets): a core
with one DRAM segment per node, puts on chosen segments, drains, and the node tasks they queue.
Imported by `test_store_drain*` and `test_store_drain_index`."""

from __future__ import annotations

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, DrainStatus, Mount, NodeTask, TaskDone, TaskKind
from yuebing.store.config import MasterConfig
from yuebing.store.master.core import MasterCore

KiB = 1024
MIGRATE = TaskKind.MIGRATE


def make(segs: int = 3, dram: int = 64 * KiB, ssd: int = 0, **cfg) -> MasterCore:
    """A core logging replication entries, with segments ``n<i>/dram`` (and SSD ones) of node ``n<i>``."""
    core = MasterCore(MasterConfig(alignment=1024, **cfg), VirtualClock(100.0))
    core.log = []
    for i in range(segs):
        assert core.handle(Mount(client=f"n{i}", segment=f"n{i}/dram", size=dram,
                                   node=f"n{i}")) == m.Ok()
        if ssd:
            assert core.handle(Mount(client=f"n{i}", segment=f"n{i}/ssd", size=ssd,
                                       tier=m.Tier.SSD, node=f"n{i}")) == m.Ok()
    return core


def put(core: MasterCore, key: str, *segs: str, size: int = 4 * KiB, **kw) -> None:
    """A committed value with one replica on each of ``segs`` (asserted placed there)."""
    r = core.handle(m.PutStart(client="c", item=m.PutItem(
        key=key, size=size, replicas=len(segs), strategy="preferred", preferred=list(segs), **kw)))
    assert [x.segment for x in r.replicas] == list(segs)
    assert core.handle(m.PutEnd(client="c", key=key)) == m.Ok()


def holders(core: MasterCore, key: str) -> list[str]:
    return [core.segs[s].name for s, _ in core.objs[key].reps]


def used(core: MasterCore, seg: str) -> int:
    return core.segs[core.seg_by_name[seg]].alloc.used


def drain(core: MasterCore, seg: str) -> int:
    """Starts (or polls) the drain of ``seg``; the number of values at risk."""
    r = core.handle(Drain(client=seg.split("/")[0], segment=seg))
    assert isinstance(r, DrainStatus), r
    return r.at_risk


def tasks(core: MasterCore) -> list[tuple[str, NodeTask]]:
    """The node tasks queued since the last call, as (node, task)."""
    out = list(core.outbox)
    core.outbox.clear()
    return out


def done(core: MasterCore, owner: str, task: NodeTask, ok: bool = True) -> None:
    assert core.handle(TaskDone(client=owner, task=task.task, ok=ok,
                                message="" if ok else "peer gone")) == m.Ok()
