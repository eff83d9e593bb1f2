"""Fixed work for counting the instructions of the shared-memory path (no timing inside):
two engines of this process, the owner with one shm segment, the peer reaching it over
``shm`` only; 50 warm-up + N ``transfer()`` calls of B requests of 64 KiB (write or read).

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \\
        benchmarks/transfer_shm_cost.py N B write

Instructions per batch = (count with N batches - count with 0) / N; valgrind's counts do not
depend on the machine's load (the kernel side of syscalls is not counted). A revision under
test goes first on ``PYTHONPATH`` (as in `transfer_before_after.sh`)."""

from __future__ import annotations

import shutil
import sys
import tempfile

import numpy as np

from yuebing.transfer import (
    EmbeddedMetadata,
    OpCode,
    TransferConfig,
    TransferEngine,
    TransferRequest,
)


def main() -> None:
    n, b, op = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="yb-cost-")
    meta = EmbeddedMetadata()
    owner = TransferEngine(TransferConfig(engine_id="o", shm_dir=shm), meta)
    owner.register_segment("s", size=b * 65536)
    peer = TransferEngine(TransferConfig(engine_id="p", transports=("shm",), shm_dir=shm), meta)
    code = OpCode.WRITE if op == "write" else OpCode.READ
    reqs = [TransferRequest(code, np.ones(65536, np.uint8), "s", i * 65536) for i in range(b)]
    try:
        for _ in range(50 + n):
            peer.transfer(reqs)
    finally:
        peer.close()
        owner.close()
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
