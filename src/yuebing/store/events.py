"""`KvEventSubscriber`: follow the master's KV-event stream (for the Conductor's KV index).

The leader master publishes `KvEvents` batches on a ZeroMQ PUB socket (``--events-address``);
each event says a block key is now STORED on, or REMOVED from, some segments. A subscriber
connects, then calls `poll` from one thread; batches that arrive before the connection settles
are missed (PUB/SUB semantics), so an index should be seeded from ``/keys`` or ``exists`` and
then kept current from the stream. ``seq`` increases by one per batch: a gap means loss.
"""

from __future__ import annotations

import logging
import typing

import zmq

from yuebing.protocol import ProtocolError, decode
from yuebing.protocol.store_cluster import KvEvents

log = logging.getLogger(__name__)


class KvEventSubscriber:
    """Subscribes to one master's event stream; not thread-safe."""

    def __init__(self, address: str) -> None:
        self.ctx: zmq.Context = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(address)
        self.last_seq = 0
        self.gaps = 0

    def poll(self, timeout_s: float = 0.0) -> list[KvEvents]:
        """Batches received within ``timeout_s`` (all that are queued, at least one if any)."""
        out: list[KvEvents] = []
        if not self.sock.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = typing.cast(KvEvents, decode(frame, KvEvents))
            except ProtocolError as e:
                log.warning("dropping a malformed event batch: %s", e)
                continue
            if self.last_seq and msg.seq != self.last_seq + 1:
                self.gaps += 1
                log.warning("event stream gap: %d after %d", msg.seq, self.last_seq)
            self.last_seq = msg.seq
            out.append(msg)

    def close(self) -> None:
        self.sock.close(0)
