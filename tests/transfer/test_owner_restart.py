"""A peer recovers as soon as a restarted owner publishes its segment again (issue 15, item 12):
a failed connection drops the cached descriptor and looks the segment up again — also for an
endpoint that never connected — with etcd metadata and with p2p metadata."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest

from etcd_util import EtcdServer, etcd_server  # noqa: F401 - fixture
from yuebing.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus

SIZE = 1 << 20


def _data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 64 << 10, dtype=np.uint8)


def _write(eng: TransferEngine, name: str, data: np.ndarray) -> TransferStatus:
    bid = eng.submit([TransferRequest(OpCode.WRITE, data, name, 4096)], timeout_s=20)
    status = eng.wait(bid, 30).status
    eng.free(bid)
    return status


def _seen_by(owner, data: np.ndarray) -> bool:  # noqa: ANN001 - conftest.Owner
    return owner.cmd(f"sum 4096 {data.nbytes}") == hashlib.blake2b(
        data, digest_size=16).hexdigest()


@pytest.mark.etcd
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_peer_recovers_from_an_owner_restart_with_etcd(
        transport: str, etcd_server: EtcdServer, spawn_owner: Callable,  # noqa: F811
        shm_dir: str, make_engine: Callable) -> None:
    """The owner is killed while its entry stays in etcd (its lease has not run out); the
    peer's writes fail (the first finds its endpoint broken, the next ones cannot connect);
    the first write after a new owner publishes the name is DONE."""
    url = "etcd://" + etcd_server.url.removeprefix("http://")
    owner = spawn_owner(SIZE, metadata=url, name=f"kv-{transport}")
    eng = make_engine(metadata=url, transports=(transport,), shm_dir=shm_dir,
                      connect_timeout_s=1.0, max_retries=1)
    first = _data(1)
    assert _write(eng, owner.name, first) == TransferStatus.DONE and _seen_by(owner, first)
    owner.kill()
    assert eng.metadata.lookup(owner.name) is not None  # the dead owner's entry is still there
    for seed in (2, 3, 4):
        assert _write(eng, owner.name, _data(seed)) == TransferStatus.FAILED
    new = spawn_owner(SIZE, metadata=url, name=f"kv-{transport}")
    assert eng.metadata.lookup(owner.name).engine_id != f"owner-{owner.proc.pid}"
    data = _data(9)
    assert _write(eng, new.name, data) == TransferStatus.DONE  # the first one after it
    assert _seen_by(new, data)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_never_connected_peer_recovers_from_a_restart_on_the_same_address_p2p(
        transport: str, spawn_owner: Callable, shm_dir: str, make_engine: Callable) -> None:
    """p2p: the peer looked the segment up (cached descriptor) but never connected; the owner
    restarts on the same port, so the name is the same and a new engine answers there. The
    peer's first write goes to the new owner."""
    owner = spawn_owner(SIZE)
    port = int(owner.name.split("/")[0].rpartition(":")[2])
    eng = make_engine(metadata="p2p", transports=(transport,), shm_dir=shm_dir)
    assert eng.describe(owner.name).engine_id == f"owner-{owner.proc.pid}"
    owner.kill()
    new = spawn_owner(SIZE, port=port)
    assert new.name == owner.name
    for seed in (5, 6):
        data = _data(seed)
        assert _write(eng, new.name, data) == TransferStatus.DONE
        assert _seen_by(new, data)
    assert eng.describe(new.name).engine_id == f"owner-{new.proc.pid}"


def test_p2p_does_not_ask_a_silent_address_twice_in_one_batch(
        spawn_owner: Callable, shm_dir: str, make_engine: Callable) -> None:
    """p2p lookups ask the owner's address itself: after it refused the connection, the batch
    fails at once (no second wait on the same address); the next batch looks it up again."""
    from yuebing.core.errors import TransferError

    owner = spawn_owner(SIZE)
    eng = make_engine(metadata="p2p", transports=("tcp",), shm_dir=shm_dir)
    eng.describe(owner.name)
    owner.kill()
    lookups: list[str] = []
    lookup = eng.metadata.lookup

    def counting(name: str):  # noqa: ANN202
        lookups.append(name)
        return lookup(name)

    eng.metadata.lookup = counting  # type: ignore[method-assign]
    assert _write(eng, owner.name, _data(7)) == TransferStatus.FAILED
    assert lookups == []
    with pytest.raises(TransferError, match="unreachable"):
        _write(eng, owner.name, _data(8))
    assert lookups == [owner.name]
