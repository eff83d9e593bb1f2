"""A transfer-engine peer process for multi-process tests.

Run as ``python peer_proc.py SEGMENT_BYTES METADATA [NAME [HAMMER_SEGMENT]]``. It registers a shared-memory
segment ``NAME`` (default ``peer``) with metadata ``p2p`` / ``embedded`` / ``etcd://...``, prints
the name peers must use for it on stdout, and serves until stdin closes. It answers notifies:
topic ``sum`` with payload ``"OFFSET LENGTH REPLY_SEGMENT"`` → notifies REPLY_SEGMENT's owner
(topic ``sum``) with the BLAKE2b-128 hex digest of those bytes of its segment, so tests can check
content independently of the transfer path that wrote it. With HAMMER_SEGMENT it also writes
32 MiB of 0x05 bytes to that (remote) segment over TCP, over and over, until killed.
"""

from __future__ import annotations

import hashlib
import queue
import sys
import threading

from yuebing.transfer import Notification, OpCode, TransferConfig, TransferEngine, TransferRequest


def main() -> None:
    size, metadata = int(sys.argv[1]), sys.argv[2]
    name = sys.argv[3] if len(sys.argv) > 3 else "peer"
    hammering = len(sys.argv) > 4
    engine = TransferEngine(TransferConfig(metadata=metadata, engine_id=f"proc-{name}",
                                           transports=("tcp",) if hammering else ("shm", "tcp")))
    seg = engine.register_segment(name, size=size)
    jobs: queue.SimpleQueue[Notification] = queue.SimpleQueue()
    engine.on_notify(jobs.put)

    def answer() -> None:
        while True:
            note = jobs.get()
            if note.topic == "sum":
                off, length, reply = note.payload.decode().split()
                digest = hashlib.blake2b(seg.view[int(off):int(off) + int(length)],
                                         digest_size=16).hexdigest()
                engine.notify(reply, "sum", digest.encode())

    threading.Thread(target=answer, daemon=True).start()
    if hammering:
        threading.Thread(target=hammer, args=(engine, sys.argv[4]), daemon=True).start()
    print(engine.segment_name(name), flush=True)
    try:
        sys.stdin.read()
    finally:
        engine.close()


def hammer(engine: TransferEngine, target: str) -> None:
    data = bytes([5]) * (32 << 20)
    while True:
        engine.transfer([TransferRequest(OpCode.WRITE, data, target, 0)])


if __name__ == "__main__":
    main()
