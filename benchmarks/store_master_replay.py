"""Drive the master core (whichever ``yuebing`` is first on the path) with a seeded random
workload and print every reply, KV event, replication entry, deferred reply and node task, and
digests of the leader's and a standby's snapshots (after a takeover too). Run it under two
source trees with the same seed and ``PYTHONHASHSEED=0``, then diff: a pure restructuring of
the master prints the same bytes.

    PYTHONHASHSEED=0 PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/store_master_replay.py 1 1500 >old
    PYTHONHASHSEED=0 PYTHONPATH=src .venv/bin/python benchmarks/store_master_replay.py 1 1500 >new
    cmp old new
"""
# ruff: noqa: E501, E702, SIM108
import hashlib
import random
import secrets
import sys

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, Mount, TaskDone, Unmount
from yuebing.store.config import MasterConfig
from yuebing.store.master import replication as R
from yuebing.store.master.core import MasterCore

seed = int(sys.argv[1])
_r = random.Random(seed * 7 + 1)
secrets.randbits = lambda k: _r.getrandbits(k)  # lease ids, task ids, reservation names
KiB = 1024
rng = random.Random(seed)
cfg = MasterConfig(alignment=1024, lease_ttl_s=rng.choice([0.0, 2.0, 5.0]), room_wait_s=rng.choice([0.0, 1.0]),
                   high_watermark=rng.choice([0.7, 0.95, 1.0]), put_timeout_s=3.0, client_ttl_s=8.0,
                   drain_parallel=2, seed=seed)
clock = VirtualClock(100.0)
core = MasterCore(cfg, clock)
core.log = []
sclock = VirtualClock(5000.0)
standby = MasterCore(cfg, sclock)
NEW = hasattr(core, "replication")  # components (issue 28) or the module functions before them
hub = R.ReplicationHub(core.replication if NEW else core, 1.0)
def load(blob):
    standby.replication.load_snapshot(blob) if NEW else R.load_snapshot(standby, blob)
def apply(entries):
    standby.replication.apply_entries(entries) if NEW else R.apply_entries(standby, entries)
def snap(c):
    return c.replication.snapshot() if NEW else R.snapshot(c)
load(hub.subscribe("sb", 1).state)
out = []
def emit(tag, x):
    out.append(f"{tag} {x}")
nodes = [f"n{i}" for i in range(4)]
for n in nodes:
    emit("mount", core.handle(Mount(client=n, segment=f"{n}/dram", size=rng.choice([32, 64]) * KiB, node=n, incarnation="a")))
    if rng.random() < 0.6:
        emit("mount", core.handle(Mount(client=n, segment=f"{n}/ssd", size=128 * KiB, tier=m.Tier.SSD, node=n, incarnation="a")))
keys, pend, resv = [], [], {}
waiter = 0
for step in range(int(sys.argv[2])):
    op = rng.random()
    c = rng.choice(["c0", "c1", "c2"])
    msg = None
    if op < 0.22:
        k = f"k{step}"
        item = m.PutItem(key=k, size=rng.choice([1, 2, 4, 8, 12]) * KiB + rng.randint(0, 3), replicas=rng.choice([1, 1, 2]),
                         soft_pin_s=rng.choice([0, 0, 3.0]), hard_pin=rng.random() < 0.05)
        msg = m.PutStart(client=c, item=item, reserve_next=rng.random() < 0.3)
        pend.append((c, k))
    elif op < 0.34 and pend:
        c, k = pend.pop(rng.randrange(len(pend)))
        msg = m.PutEnd(client=c, key=k) if rng.random() < 0.85 else m.PutRevoke(client=c, key=k, failed=[rng.choice(nodes) + "/dram"] if rng.random() < 0.2 else [])
        keys.append(k)
    elif op < 0.40:
        items = [m.PutItem(key=f"b{step}_{i}", size=4 * KiB) for i in range(rng.randint(1, 3))]
        msg = m.BatchPutStart(client=c, items=items, reserve_next=rng.choice([0, 0, 2]))
        pend.extend((c, it.key) for it in items)
    elif op < 0.46 and pend:
        ks = [pend.pop(rng.randrange(len(pend))) for _ in range(min(len(pend), 2))]
        msg = m.BatchPutEnd(client=ks[0][0], keys=[k for _, k in ks])
        keys.extend(k for _, k in ks)
    elif op < 0.60 and keys:
        waiter += 1
        r = core.handle(m.GetReplicas(key=rng.choice(keys)), ("w", waiter), None)
        emit("get", r)
        if isinstance(r, m.ReplicaList) and rng.random() < 0.6:
            emit("rel", core.handle(m.ReleaseLeases(keys=[r.key], ids=[r.lease_id])))
        continue
    elif op < 0.64 and keys:
        msg = m.BatchGetReplicas(keys=rng.sample(keys, min(3, len(keys))))
    elif op < 0.67 and keys:
        msg = rng.choice([m.Exists(key=rng.choice(keys)), m.BatchExists(keys=keys[:5]), m.PrefixMatch(keys=keys[:6])])
    elif op < 0.71 and keys:
        msg = rng.choice([m.Remove(key=rng.choice(keys), force=rng.random() < 0.3), m.BatchRemove(keys=rng.sample(keys, min(2, len(keys)))),
                          m.RemovePrefix(prefix="k1"), m.Pin(keys=[rng.choice(keys)], hard=rng.random() < 0.5, unpin=rng.random() < 0.3)])
    elif op < 0.76:
        t = core.handle(m.PutStart(client=c, item=m.PutItem(key=f"r{step}", size=2 * KiB), reserve_next=True), None, None)
        emit("rput", t)
        if isinstance(t, m.PutTargets):
            emit("rend", core.handle(m.PutEnd(client=c, key=f"r{step}")))
            keys.append(f"r{step}")
            if t.reservation is not None:
                msg = m.PutCommit(client=c, reservation=t.reservation.key, item=m.PutItem(key=f"rc{step}", size=2 * KiB),
                                  reserve_next=rng.random() < 0.5)
                keys.append(f"rc{step}")
    elif op < 0.775:
        t = core.handle(m.BatchPutStart(client=c, items=[m.PutItem(key=f"u{step}", size=2 * KiB)], reserve_next=2), None, None)
        emit("ubatch", t)
        msg = m.BatchPutRevoke(client=c, keys=[f"u{step}"], failed=[], unused=[r.key for r in getattr(t, "reservations", [])][:1])
    elif op < 0.79:
        n = rng.choice(nodes)
        msg = Drain(client=n, segment=f"{n}/dram", incarnation="a")
    elif op < 0.81:
        n = rng.choice(nodes)
        msg = rng.choice([Unmount(client=n, segment=f"{n}/dram", incarnation="a"), m.Heartbeat(client=n, incarnation="a"),
                          Mount(client=n, segment=f"{n}/dram", size=64 * KiB, node=n, incarnation=rng.choice(["a", "b"]))])
    elif op < 0.90:
        for node, task in list(core.outbox):
            emit("task", task)
            emit("done", core.handle(TaskDone(client=node, task=task.task, ok=rng.random() < 0.8, message="x")))
        core.outbox.clear()
        continue
    else:
        clock.advance_to(clock.now() + rng.choice([0.1, 0.5, 1.0, 2.5]))
        sclock.advance_to(sclock.now() + 0.3)
        for n in nodes:
            if rng.random() < 0.8:
                core.handle(m.Heartbeat(client=n, incarnation="a"))
        core.tick()
        emit("tick", sorted(core.stats().values.items()))
        continue
    if msg is not None:
        waiter += 1
        emit(type(msg).__name__, core.handle(msg, ("w", waiter) if rng.random() < 0.5 else None, None))
    emit("events", core.events); core.events = []
    emit("ready", core.ready); core.ready.clear()
    emit("log", list(core.log))
    for _, e in hub.publish():
        apply(e.entries)
    if step % 50 == 0:
        emit("snap", hashlib.sha256(snap(core)).hexdigest())
        emit("ssnap", hashlib.sha256(snap(standby)).hexdigest())
emit("final", hashlib.sha256(snap(core)).hexdigest())
standby.replication.take_over() if NEW else R.take_over(standby)
emit("takeover", hashlib.sha256(snap(standby)).hexdigest())
emit("stats", sorted(standby.stats().values.items()))
print("\n".join(out))
