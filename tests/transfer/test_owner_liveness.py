"""Shared-memory segments and their owners' liveness (issue 15, items 6, 7 and 13): a copy into
a segment whose owner died or unregistered it is never reported DONE; a segment registered again
under the same name is a new incarnation that peers remap; dead owners' files are swept."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from yuebing.core.errors import TransferError
from yuebing.transfer import (
    EmbeddedMetadata,
    OpCode,
    TransferConfig,
    TransferEngine,
    TransferRequest,
    TransferStatus,
)
from yuebing.transfer.batch import Batch, RequestState, Slice
from yuebing.transfer.liveness import (
    SHM_PREFIX,
    MappedFile,
    create_owned_file,
    owner_alive,
    sweep_dead_segments,
)
from yuebing.transfer.transport.shm import OWNER_GONE, _Worker

SIZE = 1 << 20


def _digest(data: np.ndarray) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _data(seed: int, n: int = 64 << 10) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _write(eng: TransferEngine, name: str, data: np.ndarray, offset: int = 4096):
    return eng.wait(eng.submit([TransferRequest(OpCode.WRITE, data, name, offset)],
                               timeout_s=20), 30)


# ---- the lock itself -------------------------------------------------------------------------

def test_the_owner_lock_is_held_until_unlock_and_probes_never_contend(shm_dir: str) -> None:
    path, fd = create_owned_file(shm_dir, 4096)
    assert Path(path).name.startswith(SHM_PREFIX) and os.path.getsize(path) == 4096
    a, b = MappedFile(path, 4096), MappedFile(path, 4096)
    try:
        assert a.owner_alive() and b.owner_alive()
        assert sweep_dead_segments(shm_dir) == [] and os.path.exists(path)  # live: kept
        os.close(fd)  # the owner goes (as a dead process's descriptors do)
        assert not a.owner_alive() and not b.owner_alive()  # shared probes: both see it
        assert owner_alive(a.fd) is False
    finally:
        a.close()
        b.close()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_unowned_files_of_dead_creators(shm_dir: str) -> None:
    dead = _dead_pid()
    held, unheld, legacy = (os.path.join(shm_dir, f"{SHM_PREFIX}{pid}-{n}")
                            for pid, n in ((dead, 0), (dead, 1), (os.getpid(), 99)))
    for path in (held, unheld, legacy):
        Path(path).write_bytes(b"x")
    owner_fd = os.open(held, os.O_RDONLY)  # an owner of another pid namespace, say
    fcntl.flock(owner_fd, fcntl.LOCK_EX)
    other = Path(shm_dir) / "not-a-segment"
    other.write_bytes(b"x")
    try:
        # unlocked and its creator gone: swept; locked: kept; unlocked but its creator runs
        # (an engine of an older version, which took no lock): kept
        assert sweep_dead_segments(shm_dir) == [unheld]
        assert os.path.exists(held) and os.path.exists(legacy) and other.exists()
        assert sweep_dead_segments(shm_dir) == []
    finally:
        os.close(owner_fd)
    assert sweep_dead_segments(shm_dir) == [held]


def test_unregistering_releases_the_lock_even_while_views_are_alive(shm_dir: str) -> None:
    with TransferEngine(TransferConfig(shm_dir=shm_dir, metadata="p2p")) as eng:
        seg = eng.register_segment("s", size=4096)
        view = seg.array  # a numpy view keeps the owner's own mapping alive after close
        peer = MappedFile(seg.shm_path, 4096)
        try:
            assert peer.owner_alive()
            eng.unregister_segment("s")
            assert not peer.owner_alive() and not os.path.exists(seg.shm_path)
            del view
        finally:
            peer.close()


# ---- item 6: a dead owner's segment is never reported done -----------------------------------

def test_copy_thread_checks_the_owner_after_copying(shm_dir: str) -> None:
    """The owner dies between the engine's check and the copy: the copy thread's own check,
    after copying and before reporting, fails the slices instead of reporting DONE."""
    path, fd = create_owned_file(shm_dir, SIZE)
    mapped = MappedFile(path, SIZE)
    worker = _Worker("test-shm", 1)
    try:
        batch = Batch(1, [RequestState(OpCode.WRITE, 4096, 1)], time.monotonic() + 30)  # type: ignore[arg-type]
        data = memoryview(bytes(range(256)) * 16)
        os.close(fd)  # the owner is gone by the time the copy runs
        worker.put(mapped, [Slice(batch, 0, OpCode.WRITE, data, "seg", 0)])
        assert batch.event.wait(10)
        (st,) = batch.snapshot().requests
        assert st.status == TransferStatus.FAILED and st.error.startswith(OWNER_GONE)
    finally:
        worker.stop()


def test_write_to_a_killed_owner_is_not_reported_done(spawn_owner: Callable, shm_dir: str,
                                                       make_engine: Callable) -> None:
    """kill -9 of an owner whose sockets outlive it (a forked child holds them): its same-host
    peers see no end-of-file, only the free segment lock — and no write is reported DONE."""
    owner = spawn_owner(SIZE)
    eng = make_engine(metadata="p2p", transports=("shm",), shm_dir=shm_dir,
                      connect_timeout_s=0.3)
    data = _data(1)
    assert _write(eng, owner.name, data).status == TransferStatus.DONE
    assert owner.cmd(f"sum 4096 {data.nbytes}") == _digest(data)
    owner.fork_socket_keeper()
    owner.kill()
    st = _write(eng, owner.name, _data(2))  # the cached descriptor: its file has no owner
    assert st.status == TransferStatus.FAILED, st
    assert OWNER_GONE in st.requests[0].error
    # the descriptor was dropped; looking it up again asks the (silent) owner: refused
    with pytest.raises(TransferError, match="handshake with peer"):
        _write(eng, owner.name, _data(3))
    out = np.zeros(64, np.uint8)
    with pytest.raises(TransferError, match="handshake with peer"):
        eng.submit([TransferRequest(OpCode.READ, out, owner.name, 0)])


# ---- item 13: a segment registered again is remapped ----------------------------------------

def test_reregistered_segment_is_remapped_in_process(shm_dir: str) -> None:
    meta = EmbeddedMetadata()
    with TransferEngine(TransferConfig(shm_dir=shm_dir, engine_id="own"), meta) as owner, \
            TransferEngine(TransferConfig(shm_dir=shm_dir, engine_id="peer"), meta) as peer:
        owner.register_segment("kv", size=SIZE)
        first = _data(4)
        assert _write(peer, "kv", first).status == TransferStatus.DONE
        owner.unregister_segment("kv")
        seg = owner.register_segment("kv", size=SIZE)  # a new incarnation, a new file
        for seed in (5, 6):
            data = _data(seed)
            st = _write(peer, "kv", data)
            assert st.status == TransferStatus.DONE, st
            assert (seg.array[4096:4096 + data.nbytes] == data).all()  # the owner sees it
        back = np.zeros(64 << 10, np.uint8)
        peer.transfer([TransferRequest(OpCode.READ, back, "kv", 4096)])
        assert (back == data).all()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_reregistered_segment_is_remapped_across_processes(
        transport: str, spawn_owner: Callable, shm_dir: str, make_engine: Callable) -> None:
    owner = spawn_owner(SIZE)
    eng = make_engine(metadata="p2p", transports=(transport,), shm_dir=shm_dir)
    assert _write(eng, owner.name, _data(7)).status == TransferStatus.DONE
    old = owner.path
    answer = owner.cmd("reregister").split()
    assert answer[0] == "ok" and answer[1] != old and not os.path.exists(old)
    for seed in (8, 9, 10):
        data = _data(seed)
        assert _write(eng, owner.name, data).status == TransferStatus.DONE
        assert owner.cmd(f"sum 4096 {data.nbytes}") == _digest(data)  # not the old file


# ---- item 7: dead owners' files are swept ---------------------------------------------------

def test_a_killed_owners_file_is_swept_and_a_live_ones_is_kept(spawn_owner: Callable,
                                                                shm_dir: str) -> None:
    live, dead = spawn_owner(SIZE, name="live"), spawn_owner(SIZE, name="dead")
    dead.kill()
    assert os.path.exists(dead.path)  # kill -9 leaves it
    assert sweep_dead_segments(shm_dir) == [dead.path]
    assert os.path.exists(live.path) and not os.path.exists(dead.path)
    data = _data(11, 4096)  # the live owner's segment is intact and still served
    with TransferEngine(TransferConfig(metadata="p2p", shm_dir=shm_dir)) as eng:
        assert _write(eng, live.name, data, 0).status == TransferStatus.DONE
    assert live.cmd("sum 0 4096") == _digest(data)


def test_a_peer_that_sees_an_owner_die_sweeps_its_file(spawn_owner: Callable, shm_dir: str,
                                                       make_engine: Callable) -> None:
    owner = spawn_owner(SIZE)
    eng = make_engine(metadata="p2p", transports=("shm",), shm_dir=shm_dir)
    assert _write(eng, owner.name, _data(12)).status == TransferStatus.DONE
    owner.kill()
    gone = threading.Event()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not gone.is_set():
        if not os.path.exists(owner.path):
            gone.set()
        time.sleep(0.02)
    assert gone.is_set(), "the shm peer's watcher did not sweep the dead owner's file"
