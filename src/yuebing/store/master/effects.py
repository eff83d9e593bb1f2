"""What the master core leaves for its adapter, and its counters: `Effects`.

Every component appends here instead of doing I/O: KV events, replication entries (``log``:
None on a standby), node tasks (``outbox``) and deferred replies (``ready``). `MasterService`
drains them after each request and tick; `ReplicationHub` takes ``log``; the admin server reads
``counters``.
"""

from __future__ import annotations

from typing import Any

from yuebing.protocol import Message
from yuebing.protocol.store_cluster import NodeTask

COUNTERS = ("puts", "gets", "removes", "evictions", "offloads", "promotions", "zombies",
            "dead_sessions", "no_space", "suspects", "migrations_started", "migrations_done",
            "migrations_failed", "migrations_given_up", "quarantined", "reservations_made",
            "reservations_committed", "reservations_expired", "reservations_returned",
            "inline_refused", "landed_commits", "landings_ignored")
"""The core's event counts (exported as ``_total`` counters)."""


class Effects:
    """The core's outputs since the adapter last took them, and its counters."""

    __slots__ = ("counters", "events", "log", "outbox", "ready")

    def __init__(self) -> None:
        self.events: list[tuple[int, str, list[str]]] = []
        self.log: list[list[Any]] | None = None
        self.outbox: list[tuple[str, NodeTask]] = []
        self.ready: list[tuple[object, Message]] = []
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def entry(self, entry: list[Any]) -> None:
        """Append a replication entry (leader only: nothing on a standby)."""
        if self.log is not None:
            self.log.append(entry)
