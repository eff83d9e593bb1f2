"""The read side: `Reads` answers `GetReplicas` (and its batch form) and the probes `Exists`,
`BatchExists`, `PrefixMatch`.

A read of a COMMITTED value moves it to the recent end of the LRU order, grants a read lease
(`Leases.grant`; while a drain runs, `Migrations.keep_lease` keeps a reader from before it
counted) and answers with its DRAM replicas (`Migrations.dram_replicas`). An SSD-only value is
promoted first (`Tiers.promote`: the reply waits in ``ready``), or read from the SSD tier when
no DRAM room can be made at once. A value the master holds (`Inline`) is answered in the reply,
with no lease. Probes grant nothing and change nothing. Called by
`MasterCore.handle`.
"""

from __future__ import annotations

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.leases import Leases
from yuebing.store.master.migration import Migrations
from yuebing.store.master.objects import Objects
from yuebing.store.master.state import ObjState
from yuebing.store.master.tiers import Tiers

C = m.Code
COMMITTED = ObjState.COMMITTED


class Reads:
    """Read handlers over `Objects`, `Leases`, `Migrations` and `Tiers`; no state of its own."""

    __slots__ = ("cfg", "clock", "effects", "leases", "migrations", "objects", "tiers")

    def __init__(self, cfg: MasterConfig, clock: Clock, objects: Objects, leases: Leases,
                 migrations: Migrations, tiers: Tiers, effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.objects = objects
        self.leases = leases
        self.migrations = migrations
        self.tiers = tiers
        self.effects = effects

    def get_replicas(self, msg: m.GetReplicas, waiter: object = None) -> m.Message | None:
        """`ReplicaList` with a lease, `Err`, or None: the reply waits for a promotion."""
        key = msg.key
        objs = self.objects.objs
        o = objs.get(key)
        if o is None or o.state != COMMITTED:
            return m.Err(code=int(C.NOT_FOUND), message=f"no value for {key!r}")
        self.effects.counters["gets"] += 1
        value = self.objects.inline.get(key)
        if value is not None:  # the bytes travel in the reply: no lease, nothing to release
            self.objects.touch_held(key)
            return m.ReplicaList(key=key, size=o.size, checksum=o.checksum, replicas=[],
                                 lease_s=0.0, value=value)
        now = self.clock.now()
        drains = self.migrations
        if drains.since and o.lease > now:  # only while a drain runs: a reader from
            drains.keep_lease(key, o)        # before it may still copy a draining replica
        leases = self.leases
        lid = leases.grant(key, o)
        objs[key] = objs.pop(key)  # LRU: most recent at the end
        reps = drains.dram_replicas(o, key)
        if reps:
            return m.ReplicaList(key=key, size=o.size, checksum=o.checksum, replicas=reps,
                                 lease_s=self.cfg.lease_ttl_s, lease_id=lid)
        leases.count_out(key, lid, now, end=False)  # the promotion's reply grants its own
        code, text = self.tiers.promote(key, o, waiter)
        if code == C.NO_SPACE and (ssd := self.tiers.ssd_replicas(o)):
            return m.ReplicaList(key=key, size=o.size, checksum=o.checksum, replicas=ssd,
                                 lease_s=self.cfg.lease_ttl_s,  # read from the SSD tier
                                 lease_id=leases.grant(key, o))
        return None if code == C.OK else m.Err(code=int(code), message=text)

    def batch_get_replicas(self, msg: m.BatchGetReplicas) -> m.Message:
        """`get_replicas` per key (no waiting: a value being promoted answers PROMOTING)."""
        codes: list[int] = []
        sizes: list[int] = []
        sums: list[int] = []
        reps: list[list[m.Replica]] = []
        lids: list[int] = []
        values: list[bytes | None] = []
        for key in msg.keys:
            r = self.get_replicas(m.GetReplicas(key=key), None)
            if isinstance(r, m.ReplicaList):
                codes.append(0)
                sizes.append(r.size)
                sums.append(r.checksum)
                reps.append(r.replicas)
                lids.append(r.lease_id)
                values.append(r.value)
            else:
                codes.append(r.code if isinstance(r, m.Err) else int(C.PROMOTING))
                sizes.append(0)
                sums.append(-1)
                reps.append([])
                lids.append(0)
                values.append(None)
        return m.BatchReplicaList(codes=codes, sizes=sizes, checksums=sums, replicas=reps,
                                  lease_s=self.cfg.lease_ttl_s, lease_ids=lids,
                                  values=values if any(v is not None for v in values) else [])

    def exists(self, msg: m.Exists) -> m.Message:
        o = self.objects.objs.get(msg.key)
        return m.Bools(values=[o is not None and o.state == COMMITTED])

    def batch_exists(self, msg: m.BatchExists) -> m.Message:
        get = self.objects.objs.get
        return m.Bools(values=[(o := get(k)) is not None and o.state == COMMITTED
                               for k in msg.keys])

    def prefix_match(self, msg: m.PrefixMatch) -> m.Message:
        n = 0
        get = self.objects.objs.get
        for k in msg.keys:
            o = get(k)
            if o is None or o.state != COMMITTED:
                break
            n += 1
        return m.Count(n=n)
