"""Values the master holds itself: `Inline` answers `PutInline` and `BatchPutInline`.

A value of at most ``inline_max_bytes`` with one replica and no placement is kept in the
master (`Objects.add_inline`), committed in the one request that carries it, replicated to the
standbys in that commit's entry; a get answers it in its reply (`Reads`). The held values share
``inline_capacity``: a put past it evicts the least recently read ones that are neither pinned
nor soft-pinned (soft-pinned ones last), or is refused NOT_INLINE (the client then puts it on
a segment); each counts its bytes plus `HELD_OVERHEAD`. Called by `MasterCore.handle`.
"""

from __future__ import annotations

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.objects import HELD_OVERHEAD, Objects
from yuebing.store.master.puts import Puts, err
from yuebing.store.master.reservations import check_key
from yuebing.store.master.state import ObjState

C = m.Code
COMMITTED = ObjState.COMMITTED


class Inline:
    """The rules of held values over `Objects` (which holds them) and `Puts` (item checks);
    no state of its own."""

    __slots__ = ("cfg", "clock", "effects", "objects", "puts")

    def __init__(self, cfg: MasterConfig, clock: Clock, objects: Objects, puts: Puts,
                 effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.objects = objects
        self.puts = puts
        self.effects = effects

    def put(self, msg: m.PutInline) -> m.Message:
        code, text = self.put_one(msg.client, msg.item, msg.value)
        if code == C.NOT_INLINE:
            return m.InlineRefused(max_bytes=self.max_bytes, message=text)
        return m.Ok() if code == C.OK else err(code, text)

    def batch_put(self, msg: m.BatchPutInline) -> m.Message:
        if len(msg.items) != len(msg.values):
            return err(C.BAD_REQUEST, f"{len(msg.items)} items but {len(msg.values)} values")
        one = self.put_one
        codes = [int(one(msg.client, it, v)[0]) for it, v in zip(msg.items, msg.values,
                                                                   strict=True)]
        return m.InlineCodes(codes=codes, max_bytes=self.max_bytes)

    @property
    def max_bytes(self) -> int:
        """The largest value a put may expect the master to hold now: ``inline_max_bytes``,
        or 0 when its budget cannot take even that (what is held is pinned)."""
        limit = self.cfg.inline_max_bytes
        return limit if limit and self.make_room(limit, dry=True) else 0

    def put_one(self, client: str, it: m.PutItem, value: bytes) -> tuple[C, str]:
        """Hold ``value`` as ``it`` for ``client``: OK, NOT_INLINE (put it the normal way),
        EXISTS, or BAD_REQUEST."""
        problem = self.puts.check_item(it) or check_key(it.key)
        if not problem and len(value) != it.size:
            problem = f"value of {it.key!r} has {len(value)} bytes, its item says {it.size}"
        if problem:
            return C.BAD_REQUEST, problem
        objs = self.objects
        o = objs.objs.get(it.key)
        if o is not None:  # a resend of this client's put of these bytes (reply lost): done
            if o.state == COMMITTED and o.owner == client and objs.inline.get(it.key) == value:
                return C.OK, ""
            return C.EXISTS, f"key {it.key!r} exists (values are immutable)"
        limit = self.cfg.inline_max_bytes
        if it.size > limit:
            return C.NOT_INLINE, f"{it.size} bytes: the master holds values of <= {limit}"
        if it.strategy or (it.replicas > 1 and it.min_replicas != 1):
            return C.NOT_INLINE, "replicas on distinct segments or a placement were asked for"
        if not self.make_room(it.size):
            self.effects.counters["inline_refused"] += 1
            return C.NOT_INLINE, "the master's held values are pinned up to --inline-capacity"
        objs.add_inline(client, it, value)
        return C.OK, ""

    def make_room(self, size: int, dry: bool = False) -> bool:
        """Evict the least recently read held values until ``size`` more bytes fit in
        ``inline_capacity``: unpinned ones first, then soft-pinned ones; nothing when even
        that leaves too little (hard-pinned values are never evicted). ``dry``: only whether
        it could."""
        objs = self.objects
        over = objs.inline_bytes + size + HELD_OVERHEAD - self.cfg.inline_capacity
        if over <= 0:
            return True
        now = self.clock.now()
        victims: list[str] = []
        for soft_ok in (False, True):
            for key, value in objs.inline.items():
                if over <= 0:
                    break
                o = objs.objs[key]
                if o.pin or (o.soft > now) != soft_ok:
                    continue
                victims.append(key)
                over -= len(value) + HELD_OVERHEAD
            if over <= 0:
                break
        if over > 0 or dry:
            return over <= 0
        for key in victims:
            objs.drop(key, objs.objs[key])
        self.effects.counters["evictions"] += len(victims)
        return True
