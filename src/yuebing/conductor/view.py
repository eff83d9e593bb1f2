"""Building the policy's `ClusterView`: the one pure view builder of the simulator and the live
Conductor, both of which call `build_view` for every arriving request.

Each adapter reduces its own sources (the simulator's state and `GlobalKVPool`; the live
instances' reports and a `KvIndex` fed by store and cache events) to the same inputs: a
`PrefillLoad` per prefill instance, a `PrefixLookup` of the request's leading blocks (each
instance's local run, the longest run anywhere and its holder), a `DecodeState` per decode
instance and the routed requests still in prefill. No clock, no I/O: the parity test feeds both
adapters the same inputs and compares decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from yuebing.conductor.policy.types import (
    ClusterView,
    DecodeState,
    PendingDecode,
    PrefillGroup,
    PrefillState,
    PrefixSource,
    QueuedPrefill,
)
from yuebing.core.errors import InputError
from yuebing.core.ids import InstanceId

STORE_HOLDER = "store"
"""Holder name of blocks in the store (the KV pool shared by every instance)."""


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """Load of one prefill instance, independent of the request being routed."""

    instance_id: InstanceId
    queue_s: float
    """Predicted seconds until the instance could start a new prefill (all its queued work)."""
    queued_requests: int
    node: str = ""
    waiting: tuple[QueuedPrefill, ...] = ()
    """The part of ``queue_s`` not started yet, in queueing order (the queue order may put a
    new request before some of it)."""
    time_factor: float = 1.0
    """Its prefill time now per predicted second (`PrefillState.time_factor`)."""


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """Where the request's leading blocks are cached."""

    local_blocks: tuple[int, ...]
    """Leading blocks held by each prefill instance (same order as the `PrefillLoad`s)."""
    best_blocks: int
    """Longest run of leading blocks held by any holder (instances or the store)."""
    holder: InstanceId | str | None
    """Who holds ``best_blocks`` (None when ``best_blocks`` is 0)."""
    local_extra: tuple[int, ...] = ()
    """Tokens past its ``local_blocks`` that each prefill instance's engine holds too
    (`PrefillState.local_extra_tokens`; empty: none known)."""


def build_view(now_s: float, prefills: Sequence[PrefillLoad], lookup: PrefixLookup,
               decodes: Sequence[DecodeState], *, link_bandwidth_Bps: float,
               link_latency_s: float, pending: Iterable[PendingDecode] = (),
               groups: Sequence[tuple[InstanceId, Sequence[tuple[PrefillLoad, int]]]] = (),
               twins: Sequence[Sequence[PrefillLoad]] = ()) -> ClusterView:
    """The `ClusterView` of one request (see the module docstring for who calls it).
    ``groups``: declared pipeline groups (id, per stage in layer order its load and the
    leading blocks of the request it can load: its range's store objects); ``twins``: per
    group, the loads of its whole-model twins (also among ``prefills``), or none."""
    if len(lookup.local_blocks) != len(prefills) \
            or len(lookup.local_extra) not in (0, len(prefills)):
        raise InputError(f"prefix lookup has {len(lookup.local_blocks)} local lengths and "
                         f"{len(lookup.local_extra)} extras for {len(prefills)} prefill instances")
    extras = lookup.local_extra or (0,) * len(prefills)
    states = tuple(PrefillState(p.instance_id, max(0.0, p.queue_s), p.queued_requests, n, p.node,
                                p.waiting, p.time_factor, extra)
                   for p, n, extra in zip(prefills, lookup.local_blocks, extras, strict=True))
    src = (PrefixSource(lookup.holder, lookup.best_blocks)
           if lookup.best_blocks > 0 and lookup.holder is not None else None)
    if twins and len(twins) != len(groups):
        raise InputError(f"{len(twins)} twin lists for {len(groups)} pipeline groups")

    def state(p: PrefillLoad, n: int) -> PrefillState:
        return PrefillState(p.instance_id, max(0.0, p.queue_s), p.queued_requests, n, p.node,
                            p.waiting, p.time_factor)

    pgroups = tuple(PrefillGroup(gid, tuple(state(p, n) for p, n in stages),
                                 tuple(state(t, 0) for t in (twins[g] if twins else ())))
                    for g, (gid, stages) in enumerate(groups))
    return ClusterView(now_s=now_s, prefills=states, decodes=tuple(decodes), best_prefix=src,
                       link_bandwidth_Bps=link_bandwidth_Bps, link_latency_s=link_latency_s,
                       pending_decodes=tuple(pending), groups=pgroups)


class KvIndex:
    """Block key → holders (instance ids, or `STORE_HOLDER`), and holder → keys.

    The live Conductor's global KV index: `add`/`remove` follow the store's KV events and the
    instances' ``cache_added``/``cache_removed``; `replace` installs a full resync; `drop`
    forgets a dead holder. Single-threaded (the Conductor's event loop).
    """

    __slots__ = ("_holders", "_keys")

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._keys: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def holders(self, key: int) -> frozenset[str]:
        return frozenset(self._holders.get(key, ()))

    def keys_of(self, holder: str) -> frozenset[int]:
        return frozenset(self._keys.get(holder, ()))

    def holder_names(self) -> list[str]:
        return list(self._keys)

    def add(self, holder: str, keys: Iterable[int]) -> None:
        mine = self._keys.setdefault(holder, set())
        for k in keys:
            if k not in mine:
                mine.add(k)
                self._holders.setdefault(k, set()).add(holder)

    def remove(self, holder: str, keys: Iterable[int]) -> None:
        mine = self._keys.get(holder)
        if not mine:
            return
        for k in keys:
            if k in mine:
                mine.discard(k)
                self._unlink(k, holder)

    def replace(self, holder: str, keys: Iterable[int]) -> None:
        """Make ``keys`` exactly what ``holder`` holds (a full resync)."""
        self.drop(holder)
        self.add(holder, keys)

    def drop(self, holder: str) -> None:
        for k in self._keys.pop(holder, ()):
            self._unlink(k, holder)

    def _unlink(self, key: int, holder: str) -> None:
        hs = self._holders.get(key)
        if hs is not None:
            hs.discard(holder)
            if not hs:
                del self._holders[key]

    def run_of(self, holder: str, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` that ``holder`` holds."""
        mine = self._keys.get(holder)
        if not mine:
            return 0
        for j, k in enumerate(keys):
            if k not in mine:
                return j
        return len(keys)

    def lookup(self, keys: Sequence[int], prefill_ids: Sequence[str],
               preferred: Sequence[str] = (STORE_HOLDER,)) -> PrefixLookup:
        """Leading-run lengths of ``keys`` for each of ``prefill_ids`` and the best holder.

        Among holders of the longest run the first of ``preferred`` wins (the store: loading
        from it keeps a peer instance's engine free), then ``prefill_ids`` in order, then any
        other holder by name.
        """
        run: dict[str, int] = {}
        alive: set[str] = set()
        j = 0
        for j, key in enumerate(keys):  # noqa: B007 - j is used after the loop
            held = self._holders.get(key)
            now = (alive & held if j else set(held)) if held else set()
            for gone in alive - now:
                run[gone] = j
            if not now:
                break
            alive = now
        else:
            j = len(keys)
            for h in alive:
                run[h] = j
        best = max(run.values(), default=0)
        holder: str | None = None
        if best > 0:
            winners = {h for h, n in run.items() if n == best}
            order = [*preferred, *prefill_ids, *sorted(winners)]
            holder = next(h for h in order if h in winners)
        return PrefixLookup(tuple(run.get(p, 0) for p in prefill_ids), best, holder)
