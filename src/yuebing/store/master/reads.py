"""The master's read side: `GetReplicas` (and its batch form) and the probes `Exists`,
`BatchExists`, `PrefixMatch` — handlers registered in `MasterCore.handlers`, called by
`MasterCore.handle` with the core first (`get_replicas` also with the caller's ``waiter``).

A read of a COMMITTED value moves it to the recent end of the LRU order, grants a read lease
(`leases.grant`; while a drain runs, `migration.keep_lease` keeps a reader from before it
counted) and answers with the value's DRAM replicas (`migration.dram_replicas`). An SSD-only
value is promoted into its node's DRAM first (`segments.promote`: the reply is deferred into
``core.ready``), or, when no DRAM room can be made at once, read from the SSD tier
(`segments.ssd_replicas`). Probes grant nothing and change nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.master import migration, segments
from yuebing.store.master.leases import count_out, grant
from yuebing.store.master.state import ObjState

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore

C = m.Code
COMMITTED = ObjState.COMMITTED


def get_replicas(core: MasterCore, msg: m.GetReplicas, waiter: object = None
                 ) -> m.Message | None:
    """`ReplicaList` with a lease, `Err`, or None: the reply waits for a promotion."""
    key = msg.key
    o = core.objs.get(key)
    if o is None or o.state != COMMITTED:
        return m.Err(code=int(C.NOT_FOUND), message=f"no value for {key!r}")
    core.counters["gets"] += 1
    now = core.clock.now()
    if core.drains.since and o.lease > now:  # only while a drain runs: a reader from
        migration.keep_lease(core, key, o)   # before it may still copy a draining replica
    lid = grant(core, key, o)
    core.objs[key] = core.objs.pop(key)  # LRU: most recent at the end
    reps = migration.dram_replicas(core, o, key)
    if reps:
        return m.ReplicaList(key=key, size=o.size, checksum=o.checksum, replicas=reps,
                             lease_s=core.cfg.lease_ttl_s, lease_id=lid)
    count_out(core, key, lid, now, end=False)  # the promotion's reply grants its own
    code, text = segments.promote(core, key, o, waiter)
    if code == C.NO_SPACE and (ssd := segments.ssd_replicas(core, o)):
        return m.ReplicaList(key=key, size=o.size, checksum=o.checksum, replicas=ssd,
                             lease_s=core.cfg.lease_ttl_s,  # read from the SSD tier
                             lease_id=grant(core, key, o))
    return None if code == C.OK else m.Err(code=int(code), message=text)


def batch_get_replicas(core: MasterCore, msg: m.BatchGetReplicas) -> m.Message:
    """`get_replicas` per key (no waiting: a value being promoted answers PROMOTING)."""
    codes: list[int] = []
    sizes: list[int] = []
    sums: list[int] = []
    reps: list[list[m.Replica]] = []
    lids: list[int] = []
    for key in msg.keys:
        r = get_replicas(core, m.GetReplicas(key=key), None)
        if isinstance(r, m.ReplicaList):
            codes.append(0)
            sizes.append(r.size)
            sums.append(r.checksum)
            reps.append(r.replicas)
            lids.append(r.lease_id)
        else:
            codes.append(r.code if isinstance(r, m.Err) else int(C.PROMOTING))
            sizes.append(0)
            sums.append(-1)
            reps.append([])
            lids.append(0)
    return m.BatchReplicaList(codes=codes, sizes=sizes, checksums=sums, replicas=reps,
                              lease_s=core.cfg.lease_ttl_s, lease_ids=lids)


def exists(core: MasterCore, msg: m.Exists) -> m.Message:
    o = core.objs.get(msg.key)
    return m.Bools(values=[o is not None and o.state == COMMITTED])


def batch_exists(core: MasterCore, msg: m.BatchExists) -> m.Message:
    get = core.objs.get
    return m.Bools(values=[(o := get(k)) is not None and o.state == COMMITTED for k in msg.keys])


def prefix_match(core: MasterCore, msg: m.PrefixMatch) -> m.Message:
    n = 0
    get = core.objs.get
    for k in msg.keys:
        o = get(k)
        if o is None or o.state != COMMITTED:
            break
        n += 1
    return m.Count(n=n)
