"""`KvEventIndex`: vLLM's KV-cache events as the yuebing store-block keys its prefix cache holds.

`instance.VllmInstance` feeds it vLLM's ZMQ frames (``--kv-events-config``; format at `frame`)
and sends what `take` returns in its load reports (``cache_added`` / ``cache_removed``) for the
Conductor's KV index. Keys are chained `hash_block` keys of store blocks (`KvLayout.block_keys`):
each vLLM block keeps the key of the last complete store block before it and the tokens since.
Lost events (a sequence gap) are asked again from vLLM's replay endpoint (`frame` says from
where, `replay` applies them); where they cannot be had, `reset` forgets every block and the
next `take` is a full resync. A block whose parent is unknown is skipped with its descendants:
the index may miss a prefix, never claim one the instance does not hold.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from yuebing.core.hashing import hash_block
from yuebing.core.ids import BlockHash
from yuebing.integrations.vllm.layout import KvLayout

log = logging.getLogger(__name__)


@dataclass
class _Block:
    """One vLLM block as the index knows it."""

    parent_key: BlockHash | None
    """Key of the last complete store block before this block's store block (None: root)."""
    pending: tuple[int, ...]
    """Tokens of this block's store block up to and including this block (() once the block
    completes it)."""
    pending_blocks: tuple[Any, ...]
    keys: list[BlockHash] = field(default_factory=list)
    """Store keys this block is part of."""


class KvEventIndex:
    """Store-block keys held by one vLLM instance's prefix cache, from its KV events."""

    def __init__(self, layout: KvLayout) -> None:
        self.layout = layout
        self.extra = (layout.fingerprint(),)
        self.blocks: dict[Any, _Block] = {}
        self.held: set[BlockHash] = set()
        self.added: set[BlockHash] = set()
        self.removed: set[BlockHash] = set()
        self.last_seq = -1
        self.full = False
        """The index was reset: the next `take` sends every key held as a full resync."""
        self.gaps = 0
        self.replays = 0
        self.resets = 0
        self.skipped = 0

    # ------------------------------------------------------------------ frames
    def frame(self, parts: list[bytes], live: bool = True) -> int | None:
        """One ZMQ frame ``[topic, seq, payload]`` from vLLM's publisher: the payload is a
        msgpack EventBatch ``[ts, events, rank]``, its events maps tagged ``type``
        (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). Applied when it is the next
        in sequence; after a gap nothing is applied and the first lost sequence number is
        returned: the caller asks vLLM's replay endpoint from there and hands the answer to
        `replay` (or calls `reset` where there is none). A ``live`` frame (the SUB socket,
        which never reorders or repeats) at or below the last one means the publisher
        restarted, even if its frame 0 was lost: the index starts over from it. Frames that
        are not ``live`` (a replay, or the live frame again after one) skip repeats."""
        if len(parts) != 3:
            log.warning("vLLM KV event frame of %d parts ignored", len(parts))
            return None
        seq = int.from_bytes(parts[1], "big")
        if seq <= self.last_seq:
            if not live:
                return None
            log.warning("vLLM's KV event publisher restarted (frame %d after %d); the index "
                        "starts over", seq, self.last_seq)
            self._start_over(seq - 1)
        elif seq != self.last_seq + 1:
            self.gaps += 1
            return self.last_seq + 1
        self.last_seq = seq
        self._apply_payload(parts[2])
        return None

    def replay(self, frames: list[list[bytes]]) -> bool:
        """The replay endpoint's answer to a gap (frames in order, from the first lost one):
        applied if it closes the gap; else (vLLM's buffer no longer holds them) False, and
        nothing applied."""
        seqs = [int.from_bytes(f[1], "big") for f in frames if len(f) == 3]
        if len(seqs) != len(frames) or not seqs or seqs[0] > self.last_seq + 1 or \
                any(b != a + 1 for a, b in zip(seqs, seqs[1:], strict=False)):
            return False
        for f in frames:
            self.frame(f, live=False)
        self.replays += 1
        return True

    def reset(self, seq: int) -> None:
        """Forget every block (lost events may have removed any of them) and go on from frame
        ``seq``; the next `take` is a full resync, so the Conductor drops the instance's keys
        and rebuilds them from the events that follow."""
        log.warning("vLLM KV events lost before %d and not replayed: the index starts over",
                    seq + 1)
        self._start_over(seq)

    def _start_over(self, seq: int) -> None:
        """Forget every block and go on from frame ``seq`` (see `reset`)."""
        self.cleared()
        self.full = True
        self.resets += 1
        self.last_seq = seq

    def _apply_payload(self, payload: bytes) -> None:
        try:
            batch = msgspec.msgpack.decode(payload)
            events = batch[1]
        except (msgspec.DecodeError, IndexError, TypeError) as e:
            log.warning("bad vLLM KV event batch: %s", e)
            return
        self.apply(events)

    def apply(self, events: Iterable[Mapping[str, Any]]) -> None:
        for ev in events:
            kind = ev.get("type") if isinstance(ev, Mapping) else None
            if kind == "BlockStored":
                self.stored(ev["block_hashes"], ev.get("parent_block_hash"), ev["token_ids"],
                            int(ev["block_size"]))
            elif kind == "BlockRemoved":
                self.dropped(ev["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.cleared()

    # ------------------------------------------------------------------ events
    def stored(self, hashes: list[Any], parent: Any, token_ids: list[int],
               block_size: int) -> None:
        """vLLM cached ``hashes`` (each ``block_size`` tokens of ``token_ids``) after block
        ``parent`` (None: from the prompt's start). The vLLM block that completes a store block
        gives that store block's key, held while every vLLM block in it is."""
        if block_size != self.layout.block_tokens:
            log.warning("vLLM KV event with block size %d, the layout has %d: ignored",
                        block_size, self.layout.block_tokens)
            return
        prev = _Block(None, (), ()) if parent is None else self.blocks.get(parent)
        if prev is None:
            self.skipped += len(hashes)
            return
        sbt = self.layout.store_block_tokens
        for i, h in enumerate(hashes):
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            pending = prev.pending + tokens
            in_block = (*prev.pending_blocks, h)
            if len(pending) < sbt:
                prev = self.blocks[h] = _Block(prev.parent_key, pending, in_block)
                continue
            key = hash_block(prev.parent_key, pending, self.extra)
            prev = self.blocks[h] = _Block(key, (), ())
            for vb in in_block:
                known = self.blocks.get(vb)
                if known is not None:
                    known.keys.append(key)
            if key not in self.held:
                self.held.add(key)
                self.added.add(key)
                self.removed.discard(key)

    def dropped(self, hashes: list[Any]) -> None:
        for h in hashes:
            block = self.blocks.pop(h, None)
            if block is None:
                continue
            for key in block.keys:
                if key in self.held:
                    self.held.discard(key)
                    if key in self.added:  # never reported: nothing to take back
                        self.added.discard(key)
                    else:
                        self.removed.add(key)

    def cleared(self) -> None:
        self.removed |= self.held - self.added
        self.added.clear()
        self.held.clear()
        self.blocks.clear()

    def take(self, full: bool = False) -> tuple[list[int], list[int], bool]:
        """(keys added, keys removed, full) since the last call; ``full`` (asked, or after a
        `reset`): every key held and none removed, for a report with ``cache_full_resync``."""
        full = full or self.full
        added: list[int] = sorted(self.held if full else self.added)
        removed: list[int] = [] if full else sorted(self.removed)
        self.added.clear()
        self.removed.clear()
        self.full = False
        return added, removed, full
