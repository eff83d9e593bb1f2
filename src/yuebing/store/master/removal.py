"""Removal and pinning of committed values: the master core's `Remove`, `BatchRemove`,
`RemovePrefix`, `RemoveAll` and `Pin` handlers (registered in `MasterCore.handlers`, called by
`MasterCore.handle` with the core first).

A removal is refused while the value is leased to a reader (``LEASED``: a read is in flight —
a finished read released its lease, `leases`) or hard-pinned (``PINNED``) unless forced;
`RemovePrefix` / `RemoveAll` report the values they kept that way (`Removed`). A removed
value's ranges are freed (`MasterCore._drop`: a REMOVED event and a ``del`` replication
entry). Pending puts and reservations are invisible here: only
COMMITTED objects are removed or pinned. A pin change is replicated as a ``pin`` entry (hard pin
and the soft pin's remaining seconds: entries carry no absolute times).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.master.state import ObjState

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore

C = m.Code
COMMITTED = ObjState.COMMITTED


def _reply(code: C, text: str) -> m.Message:
    return m.Ok() if code == C.OK else m.Err(code=int(code), message=text)


def remove(core: MasterCore, msg: m.Remove) -> m.Message:
    return _reply(*remove_one(core, msg.key, msg.force, core.clock.now()))


def batch_remove(core: MasterCore, msg: m.BatchRemove) -> m.Message:
    now = core.clock.now()
    return m.Codes(codes=[int(remove_one(core, k, msg.force, now)[0]) for k in msg.keys])


def remove_prefix(core: MasterCore, msg: m.RemovePrefix) -> m.Message:
    """Remove every committed value under ``msg.prefix``; the reply counts the removed ones and
    names the ones kept (leased to a reader, or hard-pinned), never skipping any silently."""
    now = core.clock.now()
    keys = [k for k, o in core.objs.items() if o.state == COMMITTED and k.startswith(msg.prefix)]
    out = m.Removed(n=0)
    for k in keys:
        code = remove_one(core, k, msg.force, now)[0]
        if code == C.OK:
            out.n += 1
        elif code in (C.LEASED, C.PINNED):
            out.kept += 1
            kept = out.leased if code == C.LEASED else out.pinned
            if len(kept) < m.REMOVED_SAMPLE:
                kept.append(k)
    return out


def remove_all(core: MasterCore, msg: m.RemoveAll) -> m.Message:
    return remove_prefix(core, m.RemovePrefix(prefix="", force=msg.force))


def remove_one(core: MasterCore, key: str, force: bool, now: float) -> tuple[C, str]:
    """Remove the committed value ``key`` unless leased or hard-pinned (``force`` overrides)."""
    o = core.objs.get(key)
    if o is None or o.state != COMMITTED:
        return C.NOT_FOUND, f"no value for {key!r}"
    if not force and o.lease > now:
        return C.LEASED, f"{key!r} is leased to a reader for {o.lease - now:.2f}s more"
    if not force and o.pin:
        return C.PINNED, f"{key!r} is hard-pinned (unpin it or force)"
    core._drop(key, o)
    core.counters["removes"] += 1
    return C.OK, ""


def pin(core: MasterCore, msg: m.Pin) -> m.Message:
    """Hard-pin, soft-pin (for ``soft_pin_s`` or the master's default) or unpin each key."""
    now = core.clock.now()
    codes: list[int] = []
    for k in msg.keys:
        o = core.objs.get(k)
        if o is None or o.state != COMMITTED:
            codes.append(int(C.NOT_FOUND))
            continue
        if msg.unpin:
            o.pin, o.soft = False, 0.0
        elif msg.hard:
            o.pin = True
        else:
            o.soft = now + (msg.soft_pin_s or core.cfg.default_soft_pin_s)
        core._log(["pin", k, o.pin, max(0.0, o.soft - now) if o.soft else 0.0])
        codes.append(0)
    return m.Codes(codes=codes)
