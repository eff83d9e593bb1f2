"""Fake transfer-engine targets for tests of the engine (never the product): a listener that
completes the handshake and then follows a script."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from yuebing.protocol.transfer import HelloReply, SlicesDone
from yuebing.transfer import EmbeddedMetadata, SegmentDescriptor
from yuebing.transfer.transport.framing import recv_frame, send_frame

Behaviour = Callable[[socket.socket, int], None]
"""What a scripted peer does after answering a frame with SlicesDone: (conn, payload bytes)."""


class ScriptedPeer:
    """Handshakes as ``engine_id``; then, with a ``behaviour``, answers every frame with success
    and runs it; without one it stalls (reads and answers nothing, keeps the connection open)."""

    def __init__(self, behaviour: Behaviour | None = None, engine_id: str = "scripted") -> None:
        self.behaviour = behaviour
        self.engine_id = engine_id
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            recv_frame(conn)
            send_frame(conn, HelloReply(engine_id=self.engine_id, host_id="elsewhere",
                                        segments=[]))
            while self.behaviour is not None and not self.stop.is_set():
                msg = recv_frame(conn)
                send_frame(conn, SlicesDone(id=msg.id, errors=[""] * len(msg.slices)))
                self.behaviour(conn, sum(s[1] for s in msg.slices))
        except OSError:
            conn.close()

    def metadata(self, segment: str = "scripted") -> EmbeddedMetadata:
        """Metadata publishing one 1 MiB segment of this peer."""
        meta = EmbeddedMetadata()
        meta.publish(self.descriptor(segment))
        return meta

    def descriptor(self, segment: str) -> SegmentDescriptor:
        return SegmentDescriptor(name=segment, engine_id=self.engine_id, host_id="elsewhere",
                                 address=f"127.0.0.1:{self.port}", size=1 << 20)

    def close(self) -> None:
        self.stop.set()
        self.srv.close()
        for c in self.conns:
            c.close()
