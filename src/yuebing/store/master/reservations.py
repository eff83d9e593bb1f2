"""The reservation book: which pending objects are reservations, for whom and of what shape,
and each client's record of recently consumed reservation names.

`Reservations` is written by `Reserve` (placing, renaming at commit) and by `Objects.drop`
(`discard`), read by `Puts` (a reservation is not ended by `PutEnd`) and carried in snapshots
and replication entries (`Replication`). The reservation rules are `reserve`'s.
"""

from __future__ import annotations

from typing import Any

from yuebing.protocol import store as m

PREFIX = m.RESERVED_PREFIX
RECENT_PER_CLIENT = 64
"""Consumed reservation names remembered per client (a retry comes within a few puts)."""
RECENT_CLIENTS = 1024
"""Clients with such a record; the one that committed least recently is forgotten first."""

Shape = tuple[int, int, str, tuple[str, ...]]
"""(size, replicas, strategy, preferred) of a `PutItem`: what a reservation was placed for."""


def shape_of(it: m.PutItem) -> Shape:
    return (it.size, it.replicas, it.strategy, tuple(it.preferred))


class Reservations:
    """The shapes and owners of the core's reservations (their objects live in `Objects`
    under their keys). ``by_client`` maps a client to its reservations per shape (shapes and
    keys oldest first);
    ``recent`` maps a client to the names of its last consumed reservations and the key each
    one's commit stored (oldest first; clients in the order they last committed)."""

    __slots__ = ("by_client", "by_key", "recent", "seq")

    def __init__(self) -> None:
        self.by_key: dict[str, tuple[str, Shape]] = {}
        self.by_client: dict[str, dict[Shape, list[str]]] = {}
        self.recent: dict[str, dict[str, str]] = {}
        self.seq = 0

    def __len__(self) -> int:
        return len(self.by_key)

    def add(self, key: str, client: str, shape: Shape) -> None:
        self.by_key[key] = (client, shape)
        self.by_client.setdefault(client, {}).setdefault(shape, []).append(key)

    def held(self, client: str, shape: Shape) -> list[str]:
        """``client``'s reservations of ``shape``, oldest first (a copy)."""
        return list(self.by_client.get(client, {}).get(shape, ()))

    def count(self, client: str) -> int:
        return sum(len(keys) for keys in self.by_client.get(client, {}).values())

    def discard(self, key: str) -> None:
        """Forget ``key`` (`Objects.drop`, and `Reserve` when it renames one)."""
        got = self.by_key.pop(key, None)
        if got is None:
            return
        client, shape = got
        mine = self.by_client.get(client)
        keys = mine.get(shape) if mine is not None else None
        if keys is not None and key in keys:
            keys.remove(key)
            if not keys:
                del mine[shape]  # type: ignore[union-attr]
                if not mine:
                    del self.by_client[client]

    def consumed(self, client: str, name: str, key: str) -> None:
        """Note that ``client``'s reservation ``name`` was renamed to ``key`` (`Reserve.rename`, on the
        leader and on standbys; `load_recent` from a snapshot)."""
        mine = self.recent.pop(client, None)  # re-inserted: the most recent client last
        if mine is None:
            if len(self.recent) >= RECENT_CLIENTS:
                del self.recent[next(iter(self.recent))]
            mine = {}
        elif len(mine) >= RECENT_PER_CLIENT:
            del mine[next(iter(mine))]
        mine[name] = key
        self.recent[client] = mine

    def consumed_for(self, client: str, name: str) -> str | None:
        """The key ``client``'s reservation ``name`` was committed to, if it is remembered."""
        mine = self.recent.get(client)
        return None if mine is None else mine.get(name)

    def new_key(self, client: str, taken: dict) -> str:
        """A fresh reservation name of ``client`` not in ``taken`` (a new leader restarts the
        sequence: names its predecessor used are skipped)."""
        while True:
            self.seq += 1
            key = f"{PREFIX}{client}/{self.seq}"
            if key not in taken:
                return key

    def renumber(self, base: int) -> None:
        """A new leader numbers reservations from ``base`` unless already past it (a retry
        must never meet a new reservation under the name its first try consumed)."""
        self.seq = max(self.seq, base)

    def clear(self) -> None:
        self.by_key.clear()
        self.by_client.clear()
        self.recent.clear()

    def dump(self) -> list[list[Any]]:
        """Snapshot rows ``[key, replicas, strategy, preferred]`` (owner and size are the
        object's)."""
        return [[k, s[1], s[2], list(s[3])] for k, (_, s) in self.by_key.items()]

    def dump_recent(self) -> list[list[Any]]:
        """Snapshot rows ``[client, [[name, key], ...]]`` of ``recent``, in its order."""
        return [[c, [[n, k] for n, k in mine.items()]] for c, mine in self.recent.items()]

    def load_recent(self, rows: list[list[Any]]) -> None:
        """Replace ``recent`` with `dump_recent`'s rows (`Replication.load_snapshot`)."""
        self.recent.clear()
        for client, pairs in rows:
            for name, key in pairs:
                self.consumed(client, name, key)


def check_key(key: str) -> str:
    """The refusal for a user key in the reserved namespace ('' when the key is fine)."""
    if key.startswith(PREFIX):
        return f"keys starting with {PREFIX!r} are reserved for the store's own reservations"
    return ""
