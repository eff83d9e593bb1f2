"""`Staging`: the KV connector's registered staging memory, handed out as byte ranges.

A prefix load from the store or a peer reads into a range until the driver thread installs it
in the engine; a save's snapshot holds one until its put is done. `yuebing.instance.connector`
takes and gives the ranges (from its load and save threads and the driver thread), so the pool
is thread-safe; snapshots waiting for their save hold at most ``save_limit`` bytes together, so
loads, which are on the TTFT path, find room while saves wait for a store in trouble.
"""

from __future__ import annotations

import threading

import torch


class Staging:
    """A bounded pool of byte ranges in one registered buffer (first fit, thread-safe). The
    ranges taken for saves (``saving``) hold at most ``save_limit`` bytes together."""

    def __init__(self, buffer: torch.Tensor, save_limit: int | None = None) -> None:
        self.buffer = buffer
        self.save_limit = buffer.numel() if save_limit is None else save_limit
        self._lock = threading.Lock()
        self._used: dict[int, tuple[int, bool]] = {}  # start -> (length, saving)
        self._saving = 0

    def take(self, nbytes: int, saving: bool = False) -> tuple[int, torch.Tensor] | None:
        """A free range of ``nbytes``: (lease, view), or None if none is (or, for a save,
        if the saves' ranges would exceed ``save_limit``)."""
        with self._lock:
            if saving and self._saving + nbytes > self.save_limit:
                return None
            start = 0
            for s, (n, _) in sorted(self._used.items()):
                if s - start >= nbytes:
                    break
                start = s + n
            if start + nbytes > self.buffer.numel():
                return None
            self._used[start] = (nbytes, saving)
            self._saving += nbytes if saving else 0
            return start + 1, self.buffer[start:start + nbytes]

    def give(self, lease: int) -> None:
        if lease:
            with self._lock:
                nbytes, saving = self._used.pop(lease - 1, (0, False))
                self._saving -= nbytes if saving else 0
