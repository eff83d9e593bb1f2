"""Small values the master holds itself, client side: whether a put asks (`wants`,
`InlineGate`), the steps of a put that asks (`put`: one `PutInline`) and of a batch of them
(`batch_put`: one `BatchPutInline`), and the copy of a value a get's reply carries (`copy_in`).
A refusal sends the value the normal way and keeps values over the size the master says it
holds off the inline path for `RETRY_S`. Called by `puts` and `gets` (both clients run these
steps).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from yuebing.core.errors import InputError
from yuebing.protocol import store as m
from yuebing.store.client.core import Call, Steps
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import INLINE_BATCH_BYTES, ClientConfig

C = m.Code
RETRY_S = 5.0
"""How long values of a size the master refused to hold are put the normal way before asking
again (its budget may have room again, or a new leader may hold them)."""
BATCH_MAX_BYTES = INLINE_BATCH_BYTES
"""Most value bytes one `BatchPutInline` carries (a master holding values takes requests of
at least twice that, `MasterConfig`)."""
NEVER = 1 << 62


class InlineGate:
    """The largest value the master lately said it holds (``limit``; 0: none, e.g. inline
    off) and until when (monotonic ``until``) larger values go the normal way."""

    __slots__ = ("limit", "until")

    def __init__(self) -> None:
        self.limit = NEVER
        self.until = 0.0

    def open(self, size: int) -> bool:
        if size <= self.limit:
            return True
        if time.monotonic() >= self.until:
            self.limit = NEVER
            return True
        return False

    def refuse(self, max_bytes: int) -> None:
        """The master refused a value and holds at most ``max_bytes`` now."""
        self.limit = max_bytes
        self.until = time.monotonic() + RETRY_S


def wants(cfg: ClientConfig, gate: InlineGate | None, size: int, replicas: int | None,
          strategy: str | None, preferred: Sequence[str] | None, best_effort: bool) -> bool:
    """Whether a put of ``size`` bytes asks the master to hold it: small enough, one replica
    (or best effort), no placement asked for (in the call or the config; the same-host
    ``local_segment`` preference is no request), and not lately refused."""
    return (gate is not None and 0 < size <= cfg.inline_max_bytes and strategy is None
            and preferred is None and not cfg.placement and not cfg.preferred
            and ((replicas or cfg.replicas) == 1 or best_effort) and gate.open(size))


def unplaced(item: m.PutItem) -> m.PutItem:
    """``item`` without its placement (strategy, preferred segments): a held value has none,
    and the same-host preference the client adds is no request (`wants`)."""
    return msgspec.structs.replace(item, strategy="", preferred=[])


def put(client: str, gate: InlineGate, item: m.PutItem, mv: memoryview) -> Steps[bool]:
    """Ask the master to hold ``item``'s value ``mv``; False when it will not
    (`InlineRefused`, or BAD_REQUEST: an older master, or a request over its size limit; the
    normal put then names any fault of the item itself). Other refusals raise
    (`StoreRpcError`)."""
    try:
        r = yield Call(m.PutInline(client=client, item=unplaced(item), value=bytes(mv)))
    except StoreRpcError as e:
        if e.code != C.BAD_REQUEST:
            raise
        gate.refuse(0)
        return False
    if isinstance(r, m.InlineRefused):
        gate.refuse(r.max_bytes)
        return False
    return True


def batch_put(client: str, gate: InlineGate, items: list[m.PutItem], mvs: list[memoryview],
              todo: list[int], codes: list[int]) -> Steps[list[int]]:
    """Ask the master to hold the items ``todo`` (all of them small enough, `BATCH_MAX_BYTES`
    in all) with one `BatchPutInline`; fills ``codes`` of those it took or refused for good,
    returns the ones to put the normal way (NOT_INLINE; all of them on BAD_REQUEST, as `put`).
    """
    try:
        r = yield Call(m.BatchPutInline(
            client=client, items=[unplaced(items[i]) for i in todo],
            values=[bytes(mvs[i]) for i in todo]))
    except StoreRpcError as e:
        if e.code != C.BAD_REQUEST:
            raise
        gate.refuse(0)
        return list(todo)
    assert isinstance(r, m.InlineCodes)
    left = []
    for i, code in zip(todo, r.codes, strict=True):
        if code == C.NOT_INLINE:
            left.append(i)
        else:
            codes[i] = code
    if left:
        gate.refuse(r.max_bytes)
    return left


def batch_fits(total: int, n: int) -> bool:
    return n > 0 and total <= BATCH_MAX_BYTES


def copy_in(key: str, mv: memoryview, value: bytes) -> None:
    """Copy a value a get's reply carried into the buffer ``mv`` (`InputError` if too small)."""
    size = len(value)
    if mv.nbytes < size:
        raise InputError(f"buffer of {mv.nbytes} bytes is too small for {key!r} ({size} bytes)")
    mv[:size] = value
