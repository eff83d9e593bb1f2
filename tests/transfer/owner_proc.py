"""A segment owner process for the liveness / restart tests of the transfer engine.

Run as ``python owner_proc.py SIZE METADATA NAME SHM_DIR [PORT]``: registers a shared-memory
segment NAME of SIZE bytes (files in SHM_DIR) with metadata ``p2p`` / ``etcd://...``, listening
on PORT (0 = any), prints ``ready <name peers use> <shm path>`` and then answers commands read
from stdin, one per line, each with one line on stdout:

* ``sum OFF LEN`` → the BLAKE2b-128 hex digest of those bytes of its segment (what the owner
  sees, whatever path wrote it);
* ``reregister`` → unregisters NAME and registers it again (same size: a new incarnation, a new
  file), answers ``ok <shm path>``;
* ``fork`` → forks a child that keeps only this process's sockets (the control connections of
  same-host peers, the listener) and no segment file, mapping or lock (it execs ``sleep`` with
  just the sockets inherited), answers ``child <pid>``: once this process is killed, its peers
  see no end-of-file, only the free segment lock. The test kills the child by that pid.

It exits when stdin closes.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import time

from yuebing.transfer import TransferConfig, TransferEngine


def fork_socket_keeper() -> int:
    """A child holding this process's sockets and nothing else: it execs ``sleep`` with only
    the sockets inherited (a mapping or an inherited segment fd would keep the lock held)."""
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.set_inheritable(fd, True)
            except OSError:
                pass
        os.execv("/bin/sleep", ["sleep", "3600"])
    deadline = time.monotonic() + 10  # answer once the child holds nothing but the sockets
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().startswith(b"sleep"):
                break
        time.sleep(0.005)
    return pid


def main() -> None:
    size, metadata, name, shm_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    port = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    engine = TransferEngine(TransferConfig(metadata=metadata, engine_id=f"owner-{os.getpid()}",
                                           shm_dir=shm_dir, port=port))
    seg = engine.register_segment(name, size=size)
    print("ready", engine.segment_name(name), seg.shm_path, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "sum":
            off, length = int(cmd[1]), int(cmd[2])
            print(hashlib.blake2b(seg.view[off:off + length], digest_size=16).hexdigest(),
                  flush=True)
        elif cmd[0] == "reregister":
            engine.unregister_segment(name)
            seg = engine.register_segment(name, size=size)
            print("ok", seg.shm_path, flush=True)
        elif cmd[0] == "fork":
            print("child", fork_socket_keeper(), flush=True)
        else:
            print("error unknown command", cmd[0], flush=True)
    engine.close()


if __name__ == "__main__":
    main()
