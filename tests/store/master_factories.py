"""Factories for the master core's unit tests (virtual clock, no sockets): a core with mounted
segments, puts (two-phase and through reservations), probes, and a leader/standby pair fed by
replication. Imported by the `test_store_*` modules of the master core."""

from __future__ import annotations

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount
from yuebing.store.config import MasterConfig
from yuebing.store.master import replication
from yuebing.store.master.core import MasterCore

KiB = 1024
SIZE = 4 * KiB
"""The value size of `start` / `commit` unless a test passes ``size``."""


def make(dram: int = 64 * KiB, segs: int = 1, ssd: int = 0, **cfg) -> tuple[MasterCore, VirtualClock]:
    """A core on a virtual clock with ``segs`` DRAM segments ``n<i>/dram`` (and SSD ones)."""
    clock = VirtualClock(100.0)
    core = MasterCore(MasterConfig(alignment=1024, **cfg), clock)
    for i in range(segs):
        assert core.handle(Mount(client=f"n{i}", segment=f"n{i}/dram", size=dram)) == m.Ok()
        if ssd:
            assert core.handle(Mount(client=f"n{i}", segment=f"n{i}/ssd", size=ssd,
                                       tier=m.Tier.SSD)) == m.Ok()
    return core, clock


def put(core: MasterCore, key: str, size: int = 4 * KiB, client: str = "c", **kw) -> m.Message:
    """A two-phase put; the `PutEnd` reply, or the `PutStart` reply when it placed nothing."""
    r = core.handle(m.PutStart(client=client, item=m.PutItem(key=key, size=size, **kw)))
    if isinstance(r, m.PutTargets):
        return core.handle(m.PutEnd(client=client, key=key))
    return r


def exists(core: MasterCore, *keys: str) -> list[bool]:
    return core.handle(m.BatchExists(keys=list(keys))).values


def start(core: MasterCore, key: str, client: str = "c", **kw) -> m.PutTargets:
    """A `PutStart` that asks for a reservation of the same shape (asserted granted)."""
    kw.setdefault("size", SIZE)
    t = core.handle(m.PutStart(client=client, item=m.PutItem(key=key, **kw), reserve_next=True))
    assert isinstance(t, m.PutTargets) and t.reservation is not None, t
    return t


def commit(core: MasterCore, resv: str, key: str, client: str = "c", nxt: bool = True,
           **kw) -> m.Message:
    """A one-RPC put through reservation ``resv`` (asking for the next one unless ``nxt`` is off)."""
    kw.setdefault("size", SIZE)
    return core.handle(m.PutCommit(client=client, reservation=resv, item=m.PutItem(key=key, **kw),
                                   reserve_next=nxt))


def durable(core: MasterCore) -> tuple:
    """The metadata a standby must reproduce: objects and segments."""
    return ({k: (o.size, o.checksum, [tuple(r) for r in o.reps], int(o.state), o.pin)
             for k, o in core.objs.items()},
            {s.id: (s.name, s.size, s.tier, s.client, int(s.state)) for s in core.segs.values()})


def leader_and_standby() -> tuple[MasterCore, MasterCore, replication.ReplicationHub]:
    cfg = MasterConfig(alignment=1024)
    leader = MasterCore(cfg, VirtualClock(10.0))
    leader.log = []
    standby = MasterCore(cfg, VirtualClock(5000.0))  # another host's clock
    hub = replication.ReplicationHub(leader.replication, 1.0)
    return leader, standby, hub


def ship(hub: replication.ReplicationHub, standby: MasterCore) -> None:
    """Applies every entry the leader published since the last call to ``standby``."""
    for _, msg in hub.publish():
        standby.replication.apply_entries(msg.entries)
