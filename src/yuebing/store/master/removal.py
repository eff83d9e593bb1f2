"""Removal and pinning of committed values: `Removal` answers `Remove`, `BatchRemove`,
`RemovePrefix`, `RemoveAll` and `Pin`.

A removal is refused while the value is leased to a reader (LEASED) or hard-pinned (PINNED)
unless forced; the prefix forms answer `Removed`, naming the values kept. A removed value goes
through `Objects.drop` (REMOVED event, ``del`` entry). Pending puts and reservations are
invisible here. A pin change is replicated as a ``pin`` entry (hard pin and the soft pin's
remaining seconds). Called by `MasterCore.handle`.
"""

from __future__ import annotations

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.objects import Objects
from yuebing.store.master.state import ObjState

C = m.Code
COMMITTED = ObjState.COMMITTED


class Removal:
    """Remove and pin handlers over `Objects`; no state of its own."""

    __slots__ = ("cfg", "clock", "effects", "objects")

    def __init__(self, cfg: MasterConfig, clock: Clock, objects: Objects,
                 effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.objects = objects
        self.effects = effects

    def remove(self, msg: m.Remove) -> m.Message:
        code, text = self.remove_one(msg.key, msg.force, self.clock.now())
        return m.Ok() if code == C.OK else m.Err(code=int(code), message=text)

    def batch_remove(self, msg: m.BatchRemove) -> m.Message:
        now = self.clock.now()
        return m.Codes(codes=[int(self.remove_one(k, msg.force, now)[0]) for k in msg.keys])

    def remove_prefix(self, msg: m.RemovePrefix) -> m.Message:
        """Remove every committed value under ``msg.prefix``; the reply counts the removed ones and
        names the ones kept (leased to a reader, or hard-pinned), never skipping any silently."""
        now = self.clock.now()
        keys = [k for k, o in self.objects.objs.items()
                if o.state == COMMITTED and k.startswith(msg.prefix)]
        out = m.Removed(n=0)
        for k in keys:
            code = self.remove_one(k, msg.force, now)[0]
            if code == C.OK:
                out.n += 1
            elif code in (C.LEASED, C.PINNED):
                out.kept += 1
                kept = out.leased if code == C.LEASED else out.pinned
                if len(kept) < m.REMOVED_SAMPLE:
                    kept.append(k)
        return out

    def remove_all(self, msg: m.RemoveAll) -> m.Message:
        return self.remove_prefix(m.RemovePrefix(prefix="", force=msg.force))

    def remove_one(self, key: str, force: bool, now: float) -> tuple[C, str]:
        """Remove the committed value ``key`` unless leased or hard-pinned (``force`` overrides)."""
        o = self.objects.objs.get(key)
        if o is None or o.state != COMMITTED:
            return C.NOT_FOUND, f"no value for {key!r}"
        if not force and o.lease > now:
            return C.LEASED, f"{key!r} is leased to a reader for {o.lease - now:.2f}s more"
        if not force and o.pin:
            return C.PINNED, f"{key!r} is hard-pinned (unpin it or force)"
        self.objects.drop(key, o)
        self.effects.counters["removes"] += 1
        return C.OK, ""

    def pin(self, msg: m.Pin) -> m.Message:
        """Hard-pin, soft-pin (for ``soft_pin_s`` or the master's default) or unpin each key."""
        now = self.clock.now()
        codes: list[int] = []
        for k in msg.keys:
            o = self.objects.objs.get(k)
            if o is None or o.state != COMMITTED:
                codes.append(int(C.NOT_FOUND))
                continue
            if msg.unpin:
                o.pin, o.soft = False, 0.0
            elif msg.hard:
                o.pin = True
            else:
                o.soft = now + (msg.soft_pin_s or self.cfg.default_soft_pin_s)
            self.effects.entry(["pin", k, o.pin, max(0.0, o.soft - now) if o.soft else 0.0])
            codes.append(0)
        return m.Codes(codes=codes)
