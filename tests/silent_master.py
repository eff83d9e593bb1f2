"""A store master that does not answer: it accepts every connection and reads what it is sent,
but never replies (what a client sees of a master that is stopped — SIGSTOP — or behind a
partition that stalls an established connection)."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Iterator


class SilentMaster:
    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.received = 0
        """Bytes read from the clients (requests that reached it)."""
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, name="silent-master", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                if key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    self.connections += 1
                    self._conns.append(conn)
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                assert isinstance(key.fileobj, socket.socket)
                data = key.fileobj.recv(1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                self.received += len(data)
        sel.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        for c in self._conns:
            c.close()
        self.listener.close()


@contextlib.contextmanager
def silent_master() -> Iterator[SilentMaster]:
    m = SilentMaster()
    try:
        yield m
    finally:
        m.close()
