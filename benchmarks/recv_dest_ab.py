#!/usr/bin/env python3
"""Where a loopback TCP receive lands: a put RPC (header + ``--size`` payload, 8-byte answer)
into destinations of different kinds, interleaved, to tell what a store node's receive into its
segment pays beside the raw socket RPC's one cache-hot buffer (issue 29). A child receives on
one connection; each call names its destination (`VARIANTS`). Variants take turns in chunks of
``--chunk`` calls for ``--rounds`` rounds; reported: median µs per call, the median of the
per-round ratios to ``hot``, the receiver's page faults per call of each variant (and how much
of its anonymous memory had huge pages).

    .venv/bin/python benchmarks/recv_dest_ab.py --size 1MiB --span 512MiB --rounds 15
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import socket
import statistics
import struct
import tempfile
import time

from yuebing.core.config import parse_size

VARIANTS = ("hot", "walk", "walk_thp", "walk_shm")
"""``hot``: one slot of a prefaulted anonymous buffer (the raw RPC's reference); ``walk``: slot i
of ``--span`` bytes of prefaulted anonymous memory, 4 KiB pages (``MADV_NOHUGEPAGE``);
``walk_thp``: the same with ``MADV_HUGEPAGE`` (where the machine allows it); ``walk_shm``: slot i
of a prefaulted shared-memory file mapping, as a store node's segment."""
HEAD = struct.Struct("<BQ")  # variant, slot


def _anon(span: int, huge: bool) -> mmap.mmap:
    m = mmap.mmap(-1, span, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    return m


def _shm(span: int) -> mmap.mmap:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="recv-dest-ab-")
    try:
        os.ftruncate(fd, span)
        return mmap.mmap(fd, span, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.unlink(path)
        os.close(fd)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("sender closed")
        got += k


def receiver(lsock: socket.socket, size: int, span: int) -> None:
    """Child: serve one connection until it closes, then print faults per variant (JSON)."""
    maps = {"hot": _anon(size, False), "walk": _anon(span, False),
            "walk_thp": _anon(span, True), "walk_shm": _shm(span)}
    for m in maps.values():  # prefault every page, as the node's segment and the raw server
        mv = memoryview(m)
        for off in range(0, len(m), 4096):
            mv[off] = 1
    views = {k: memoryview(m) for k, m in maps.items()}
    faults = dict.fromkeys(VARIANTS, 0)
    calls = dict.fromkeys(VARIANTS, 0)
    conn, _ = lsock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = memoryview(bytearray(HEAD.size))
    with conn:
        while True:
            try:
                _recv_exact(conn, head)
            except ConnectionError:
                break
            v, slot = HEAD.unpack(head)
            name = VARIANTS[v]
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            off = slot * size
            _recv_exact(conn, views[name][off:off + size])
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            calls[name] += 1
            conn.sendall(b"\0" * 8)
    out: dict[str, float] = {k: faults[k] / max(1, calls[k]) for k in VARIANTS}
    with open("/proc/self/smaps_rollup") as f:  # did walk_thp get huge pages?
        out["anon_huge_mib"] = next((int(line.split()[1]) / 1024 for line in f
                                     if line.startswith("AnonHugePages:")), 0.0)
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1MiB")
    ap.add_argument("--span", default="512MiB")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--json", default="")
    ns = ap.parse_args()
    size, span = parse_size(ns.size), parse_size(ns.span)
    slots = span // size
    lsock = socket.create_server(("127.0.0.1", 0))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        try:
            receiver(lsock, size, span)
        finally:
            os._exit(0)
    os.close(w)
    sock = socket.create_connection(lsock.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(os.urandom(size))
    ack = memoryview(bytearray(8))
    per: dict[str, list[float]] = {k: [] for k in VARIANTS}
    slot = dict.fromkeys(VARIANTS, 0)
    for rnd in range(ns.rounds + 1):
        order = VARIANTS if rnd % 2 else VARIANTS[::-1]
        for name in order:
            lat = []
            for _ in range(ns.chunk):
                s = 0 if name == "hot" else slot[name] % slots
                slot[name] += 1
                t0 = time.perf_counter()
                sock.sendall(HEAD.pack(VARIANTS.index(name), s))
                sock.sendall(payload)
                _recv_exact(sock, ack)
                lat.append(time.perf_counter() - t0)
            if rnd:  # the first round warms up
                per[name].append(statistics.median(lat) * 1e6)
    sock.close()
    faults = json.loads(os.fdopen(r).read() or "{}")
    os.waitpid(pid, 0)
    out = {}
    for name in VARIANTS:
        ratios = [h / x for h, x in zip(per["hot"], per[name], strict=True)]
        out[name] = {"us": round(statistics.median(per[name]), 1),
                     "rate_vs_hot": round(statistics.median(ratios), 3),
                     "faults_per_call": round(faults.get(name, 0.0), 2)}
        print(f"{name:9s} {out[name]['us']:8.1f} us  rate vs hot {out[name]['rate_vs_hot']:.3f}"
              f"  faults/call {out[name]['faults_per_call']}")
    out["receiver"] = {"anon_huge_mib": faults.get("anon_huge_mib", 0.0)}
    print(f"receiver's anonymous memory in huge pages: {faults.get('anon_huge_mib', 0.0):.0f} MiB")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
