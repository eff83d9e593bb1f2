"""The receiving side of transfer-engine notifications (`TransferEngine.notify`).

A `NotifyInbox` belongs to one `TransferEngine`: its TCP server's connection threads (and the
engine itself, for a notify to one of its own segments) call `deliver` with each arriving
`Notify`; the engine's users either `subscribe` a callback, which then runs in the delivering
thread for every notification, or take queued ones with `get`. A full queue refuses the
notification, and the sender's `notify` then fails with the reason.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from yuebing.core.errors import TransferError
from yuebing.protocol.transfer import Notify
from yuebing.transfer.types import Notification


class NotifyInbox:
    """Arriving notifications: handed to the subscribed callbacks, else queued for `get`."""

    def __init__(self, owner: str, capacity: int) -> None:
        self.owner = owner
        self._queue: queue.Queue[Notification] = queue.Queue(capacity)
        self._callbacks: list[Callable[[Notification], None]] = []

    def subscribe(self, callback: Callable[[Notification], None]) -> None:
        """Call ``callback(notification)`` for each arriving notify instead of queueing it."""
        self._callbacks.append(callback)

    def get(self, timeout_s: float | None = None) -> Notification | None:
        """The oldest queued notification, waiting up to ``timeout_s``; None if none came."""
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def deliver(self, msg: Notify) -> None:
        """Hand ``msg`` to the callbacks or the queue; raises `TransferError` if it is full."""
        note = Notification(msg.sender, msg.topic, msg.payload)
        if self._callbacks:
            for cb in list(self._callbacks):
                cb(note)
            return
        try:
            self._queue.put_nowait(note)
        except queue.Full:
            raise TransferError(f"notify queue of {self.owner} is full") from None
