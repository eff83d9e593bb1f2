#!/usr/bin/env python3
"""Receiving a write payload over loopback TCP: polling (`FrameReader(spin_s=...)`, the default
of lanes, the inline path and the server) vs sleeping in the kernel, next to a bare-socket floor.

A child process serves three connections, one per variant; the parent writes one frame of
``--size`` bytes (header + payload in one ``sendmsg``) and waits for the 16-byte answer, taking
turns between the variants in rounds of ``--chunk`` frames so drifts of machine load hit them
alike. Reported: median µs per write+answer over the rounds (first round dropped as warm-up).
The destination cycles through 100 MiB, as fresh store allocations would (cold in cache).

    .venv/bin/python benchmarks/tcp_receive_spin.py [--size 1048576] [--rounds 16] [--json OUT]

Variants: ``floor`` — bare socket, blocking read of a fixed 64-byte header then non-blocking
``recv_into`` polling for the payload; ``frame_spin`` — `FrameReader` with ``spin_s`` = 50 µs
(msgspec header, ``spin_scatter``); ``frame_sleep`` — `FrameReader` without spinning (poll +
``recvmsg_into(MSG_WAITALL)``, the code before spin_scatter).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import threading
import time

from yuebing.protocol.transfer import SlicesDone, WriteSlices
from yuebing.transfer.transport.framing import FrameReader, frame_parts, send_parts, tune_socket

VARIANTS = ("floor", "frame_spin", "frame_sleep")
CYCLE = 100 << 20


def _serve_floor(c: socket.socket, mv: memoryview, size: int) -> None:
    off, hdr = 0, memoryview(bytearray(64))
    while True:
        got = 0
        while got < 64:
            n = c.recv_into(hdr[got:])
            if n == 0:
                return
            got += n
        view, got = mv[off:off + size], 0
        while got < size:
            try:
                got += c.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
        c.sendall(b"k" * 16)
        off = (off + size) % CYCLE


def _serve_frames(c: socket.socket, mv: memoryview, size: int, spin_s: float) -> None:
    c.settimeout(30)
    reader, off = FrameReader(c, spin_s=spin_s), 0
    while True:
        try:
            msg = reader.read()
        except (OSError, ConnectionError):
            return
        reader.read_into_many([mv[off:off + size]])
        send_parts(c, frame_parts(SlicesDone(id=msg.id, errors=[""])))  # type: ignore[attr-defined]
        off = (off + size) % CYCLE


def _child(listeners: list[socket.socket], size: int) -> None:
    mv = memoryview(mmap.mmap(-1, CYCLE + size))
    threads = []
    for name, lsock in zip(VARIANTS, listeners, strict=True):
        c, _ = lsock.accept()
        tune_socket(c, 4 << 20, None)
        target = {"floor": lambda c=c: _serve_floor(c, mv, size),
                  "frame_spin": lambda c=c: _serve_frames(c, mv, size, 50e-6),
                  "frame_sleep": lambda c=c: _serve_frames(c, mv, size, 0.0)}[name]
        threads.append(threading.Thread(target=target, daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=40)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in VARIANTS]
    pid = os.fork()
    if pid == 0:
        try:
            _child(listeners, a.size)
        finally:
            os._exit(0)
    conns = []
    for lsock in listeners:
        s = socket.create_connection(lsock.getsockname())
        tune_socket(s, 4 << 20, 30)
        conns.append(s)
    data = memoryview(os.urandom(a.size))
    readers = [FrameReader(s) for s in conns]
    per: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for rnd in range(a.rounds + 1):
            for i, name in enumerate(VARIANTS):
                s, ts = conns[i], []
                for k in range(a.chunk):
                    t = time.perf_counter()
                    if name == "floor":
                        s.sendmsg([b"h" * 64, data])
                        got = 0
                        while got < 16:
                            got += len(s.recv(16 - got))
                    else:
                        send_parts(s, frame_parts(WriteSlices(
                            id=k, segment="x", slices=[(0, a.size, 0, a.size)],
                            expiry=time.time() + 60), data))
                        readers[i].read()
                    ts.append(time.perf_counter() - t)
                if rnd:
                    per[name].append(statistics.median(ts))
            print(f"\rround {rnd}/{a.rounds}", end="", flush=True)
    finally:
        for s in conns:
            s.close()
        os.waitpid(pid, 0)
    print()
    rows = {v: round(statistics.median(x) * 1e6, 1) for v, x in per.items()}
    print(f"{a.size} B write + answer, median us over {a.rounds} rounds of {a.chunk}: {rows}")
    print(f"frame_sleep / frame_spin = {rows['frame_sleep'] / rows['frame_spin']:.2f}x; "
          f"frame_spin / floor = {rows['frame_spin'] / rows['floor']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size": a.size, "rounds": a.rounds, "median_us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
