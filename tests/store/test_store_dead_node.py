"""A same-host node killed with SIGKILL (issue 15, items 3 and 6): a batch put blames exactly
the dead node's segment and re-places only its items; no copy into a dead node's segment is
reported done, so the store never commits a value there."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
from store_procs import Proc, master, node

from yuebing.protocol import store as m
from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.client.direct import DirectSegments
from yuebing.store.config import ClientConfig
from yuebing.transfer import OpCode, TransferRequest, TransferStatus
from yuebing.transfer.liveness import create_owned_file
from yuebing.transfer.transport.shm import OWNER_GONE

N, SIZE = 16, 1 << 20


@pytest.fixture()
def two_nodes() -> Iterator[tuple[Proc, Proc, Proc]]:
    mst = master()
    a = node(mst.info["address"], "64MiB", "--name", "dies")
    b = node(mst.info["address"], "64MiB", "--name", "lives")
    yield mst, a, b
    a.kill()
    b.stop()
    mst.stop()


def _values(seed: int) -> list[bytes]:
    return [bytes([(seed + i) % 256]) * SIZE for i in range(N)]


@pytest.mark.parametrize("reserve_ahead", [True, False])
def test_batch_put_after_a_same_host_node_is_killed_blames_only_it(
        two_nodes: tuple[Proc, Proc, Proc], reserve_ahead: bool) -> None:
    mst, dead, _ = two_nodes
    cfg = ClientConfig(master=mst.info["address"], reserve_ahead=reserve_ahead)
    dead.kill()
    with StoreClient(cfg, heartbeat=False) as c:
        revokes: list[m.BatchPutRevoke] = []
        call = c.rpc.call

        def recording(msg: m.Message) -> m.Message:
            if isinstance(msg, m.BatchPutRevoke):
                revokes.append(msg)
            return call(msg)

        c.rpc.call = recording  # type: ignore[method-assign]
        vals = _values(1)
        assert c.batch_put([f"k{i}" for i in range(N)], vals) == [0] * N
        blamed = {s for r in revokes for s in r.failed}
        assert blamed and all(s.endswith("/dies.dram") for s in blamed), blamed
        # only the dead node's items were revoked and placed again
        assert 0 < len({k for r in revokes for k in r.keys if k.startswith("k")}) < N
        for i, v in enumerate(vals):
            assert bytes(c.get(f"k{i}")) == v
        assert c.batch_put([f"again{i}" for i in range(N)], _values(2)) == [0] * N


def test_async_batch_put_after_a_same_host_node_is_killed(
        two_nodes: tuple[Proc, Proc, Proc]) -> None:
    mst, dead, _ = two_nodes
    dead.kill()

    async def run() -> list[int]:
        async with AsyncStoreClient(ClientConfig(master=mst.info["address"])) as c:
            codes = await c.batch_put([f"a{i}" for i in range(N)], _values(3))
            assert bytes(await c.get("a5")) == _values(3)[5]
            return codes

    assert asyncio.run(run()) == [0] * N


class _Engine:
    """What `DirectSegments` asks of the transfer engine: one same-host shm segment."""

    host_id = "here"

    def __init__(self, path: str, size: int) -> None:
        self.config = type("Cfg", (), {"transports": ("shm", "tcp")})()
        self.desc = type("Desc", (), {"shm_path": path, "host_id": "here", "size": size})()

    def describe(self, segment: str) -> object:
        return self.desc


class _DiesMidCopy(DirectSegments):
    """The node dies after the client checked it and while the copies run."""

    owner_fd = -1

    def _run(self, jobs, deadline):  # type: ignore[no-untyped-def]
        if self.owner_fd >= 0:
            os.close(self.owner_fd)
            self.owner_fd = -1
        return super()._run(jobs, deadline)


def test_a_direct_copy_into_a_node_that_dies_mid_copy_is_not_done(tmp_path) -> None:
    path, fd = create_owned_file(str(tmp_path), 4 << 20)
    direct = _DiesMidCopy(_Engine(path, 4 << 20))  # type: ignore[arg-type]
    try:
        data = memoryview(b"v" * (1 << 20))
        (ok,) = direct.copy([TransferRequest(OpCode.WRITE, data, "seg", 0, data.nbytes)],
                            time.monotonic() + 30)
        assert ok is not None and ok.status == TransferStatus.DONE
        direct.owner_fd = fd
        (late,) = direct.copy([TransferRequest(OpCode.WRITE, data, "seg", 1 << 20, data.nbytes)],
                              time.monotonic() + 30)
        assert late is not None and late.status == TransferStatus.FAILED
        assert late.error.startswith(OWNER_GONE)
        # the next batch finds the node dead before copying: left to the engine
        assert direct.copy([TransferRequest(OpCode.WRITE, data, "seg", 0, data.nbytes)],
                           time.monotonic() + 30) == [None]
    finally:
        direct.close()


@pytest.mark.slow
def test_a_node_sweeps_dead_segment_files_periodically(tmp_path) -> None:
    """Files of same-host engines that died after the node started (so its engine's start-up
    sweep did not see them) go at the node's periodic sweep; a locked one stays."""
    import fcntl
    import subprocess
    import tempfile

    from yuebing.store.node.service import SHM_SWEEP_S
    from yuebing.transfer.liveness import SHM_PREFIX

    shm = tempfile.mkdtemp(prefix="yb-test-shm-", dir="/dev/shm")
    mst = master()
    nd = node(mst.info["address"], "4MiB", "--name", "sweeper", "--tx-shm-dir", shm)
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()
        dead, held = (os.path.join(shm, f"{SHM_PREFIX}{gone.pid}-{n}") for n in (0, 1))
        for path in (dead, held):
            with open(path, "wb") as f:
                f.write(b"x")
        fd = os.open(held, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        deadline = time.monotonic() + 3 * SHM_SWEEP_S
        while os.path.exists(dead) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(dead) and os.path.exists(held)
        os.close(fd)
    finally:
        nd.stop()
        mst.stop()
        for name in os.listdir(shm):
            os.unlink(os.path.join(shm, name))
        os.rmdir(shm)
