"""Robustness: dead peers fail promptly with a clear error, stalled peers time out, broken lanes
are retried on another lane, and a process that lost a peer keeps serving the others."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from fake_peers import ScriptedPeer

from yuebing.transfer import (
    EmbeddedMetadata,
    OpCode,
    SegmentDescriptor,
    TransferConfig,
    TransferEngine,
    TransferRequest,
    TransferStatus,
)

BIG = 256 << 20


def test_peer_killed_mid_transfer_fails_fast_and_survivor_serves(spawn_peer, make_engine) -> None:
    victim = spawn_peer(BIG, name="victim")
    other = spawn_peer(1 << 20, name="other")
    eng: TransferEngine = make_engine(metadata="p2p", transports=("tcp",), lanes=2,
                                      slice_size=1 << 20, retry_backoff_s=0.005)
    eng.register_segment("reply", size=4096)
    data = np.ones(BIG, np.uint8)
    eng.transfer([TransferRequest(OpCode.WRITE, data[:1 << 20], victim.name, 0)], timeout_s=10)
    # frozen, the victim acknowledges nothing, so the batch is still in flight at the kill
    # (unfrozen, 256 MiB over loopback can be all acknowledged in ~0.2 s, before a kill lands)
    victim.freeze()
    bid = eng.submit([TransferRequest(OpCode.WRITE, data[i << 24:(i + 1) << 24], victim.name,
                                      i << 24) for i in range(16)], timeout_s=30)
    time.sleep(0.1)  # the lanes fill the frozen peer's socket buffers
    assert not eng.status(bid).status.terminal
    t0 = time.monotonic()
    victim.kill()
    st = eng.wait(bid, 30)
    elapsed = time.monotonic() - t0
    assert st.status == TransferStatus.FAILED, st
    assert elapsed < 5.0, f"dead peer noticed only after {elapsed:.1f}s"
    address = victim.name.split("/")[0]
    assert any(address in r.error for r in st.requests if r.error), st.errors
    # the surviving process still moves data to, and serves traffic from, its other peers
    payload = np.arange(1 << 20, dtype=np.uint8)
    eng.transfer([TransferRequest(OpCode.WRITE, payload, other.name, 0)], timeout_s=10)
    eng.notify(other.name, "sum", f"0 {1 << 20} {eng.segment_name('reply')}".encode())
    note = eng.next_notify(10)
    assert note is not None
    assert note.payload.decode() == hashlib.blake2b(payload, digest_size=16).hexdigest()
    # and a new request to the dead peer fails at once with the peer named
    t0 = time.monotonic()
    st = eng.wait(eng.submit([TransferRequest(OpCode.WRITE, payload, victim.name, 0)]), 10)
    assert st.status == TransferStatus.FAILED and address in st.requests[0].error
    assert time.monotonic() - t0 < 5.0


def test_initiator_killed_mid_write_target_keeps_serving(spawn_peer, make_engine) -> None:
    target: TransferEngine = make_engine(metadata="p2p", engine_id="target")
    hammered = 32 << 20  # the writer keeps rewriting [0, 32 MiB); the page after it is ours
    seg = target.register_segment("victim", size=hammered + 4096)
    writer = spawn_peer(4096, name="writer", hammer=target.segment_name("victim"))
    deadline = time.monotonic() + 20
    while seg.array[hammered - 1] != 5 and time.monotonic() < deadline:
        time.sleep(0.005)  # wait until the writer's first full write has landed
    assert seg.array[hammered - 1] == 5
    writer.kill()  # SIGKILL, most likely in the middle of a 32 MiB payload
    # the target keeps serving: another engine writes and reads back exactly (in the page the
    # writer never touches, since its last bytes may still be draining from the socket)
    fresh: TransferEngine = make_engine(metadata="p2p", transports=("tcp",))
    name = target.segment_name("victim")
    fresh.transfer([TransferRequest(OpCode.WRITE, b"abc" * 100, name, hammered + 8)],
                   timeout_s=10)
    out = bytearray(300)
    fresh.transfer([TransferRequest(OpCode.READ, out, name, hammered + 8)], timeout_s=10)
    assert bytes(out) == b"abc" * 100
    assert bytes(seg.view[hammered + 8:hammered + 308]) == b"abc" * 100


@pytest.mark.parametrize("inline", [False, True])
def test_stalled_peer_times_out_within_deadline(inline: bool) -> None:
    """Through the lanes, or the inline path (whose blocking read is cut at the deadline)."""
    peer = ScriptedPeer(engine_id="staller")  # handshakes, then never answers
    meta = peer.metadata("stuck")
    with TransferEngine(TransferConfig(transports=("tcp",)), metadata=meta) as eng:
        t0 = time.monotonic()
        bid = eng.submit([TransferRequest(OpCode.READ, bytearray(4096), "stuck", 0)],
                         timeout_s=0.3, inline=inline)
        st = eng.wait(bid, 5)
        elapsed = time.monotonic() - t0
        assert st.status == TransferStatus.TIMEOUT
        assert "deadline passed" in st.requests[0].error
        assert 0.3 <= elapsed < 1.5
    peer.close()


def test_unreachable_peer_fails_at_once_with_its_address() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed again below: nothing listens there
    meta = EmbeddedMetadata()
    meta.publish(SegmentDescriptor(name="gone", engine_id="ghost", host_id="elsewhere",
                                   address=f"127.0.0.1:{port}", size=1 << 20))
    with TransferEngine(TransferConfig(transports=("tcp",)), metadata=meta) as eng:
        st = eng.wait(eng.submit([TransferRequest(OpCode.WRITE, b"x" * 10, "gone", 0)]), 5)
        assert st.status == TransferStatus.FAILED
        assert f"peer at 127.0.0.1:{port} is unreachable" in st.requests[0].error


def test_broken_lane_is_retried_on_another_lane(spawn_peer, make_engine) -> None:
    """A lane that breaks with slices in flight hands them back and they are retried on the
    other lanes: the peer is frozen from before the batch until the lane has broken, so none
    of them can have been acknowledged (unfrozen, 64 MiB over loopback can all be, first)."""
    peer = spawn_peer(64 << 20, name="r")
    eng: TransferEngine = make_engine(metadata="p2p", transports=("tcp",), lanes=3,
                                      slice_size=256 << 10, retry_backoff_s=0.001)
    eng.register_segment("reply", size=4096)
    eng.transfer([TransferRequest(OpCode.WRITE, b"r", peer.name, 0)], timeout_s=10)  # lanes up
    ep = eng._peers.endpoint(eng.describe(peer.name))  # the one TCP endpoint to the peer
    broken = ep._lanes[0]
    data = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    peer.freeze()
    bid = eng.submit([TransferRequest(OpCode.WRITE, data, peer.name, 0)], timeout_s=30)
    assert broken.outstanding > 0 and not eng.status(bid).status.terminal
    broken.sock.shutdown(socket.SHUT_RDWR)  # break one lane mid-batch
    deadline = time.monotonic() + 10
    while not broken.dead and time.monotonic() < deadline:
        time.sleep(0.001)
    assert broken.dead and not eng.status(bid).status.terminal  # its slices wait for a retry
    peer.thaw()
    st = eng.wait(bid, 30)
    assert st.status == TransferStatus.DONE, st.errors
    assert broken not in ep._lanes
    eng.notify(peer.name, "sum", f"0 {data.nbytes} {eng.segment_name('reply')}".encode())
    note = eng.next_notify(10)
    assert note is not None
    assert note.payload.decode() == hashlib.blake2b(data, digest_size=16).hexdigest()


def test_pool_is_capped_with_sieve_eviction(make_engine: Callable[..., TransferEngine]) -> None:
    owners = [make_engine(engine_id=f"o{i}") for i in range(3)]
    for i, o in enumerate(owners):
        o.register_segment(f"s{i}", size=4096)
    eng = make_engine(transports=("tcp",), max_endpoints=2, lanes=1)
    for i in (0, 1, 2, 0):
        eng.transfer([TransferRequest(OpCode.WRITE, b"z", f"s{i}", 0)])
    assert eng.stats()["endpoints"] == 2 and eng.stats()["evictions"] == 2


def test_silent_peer_handshake_times_out_twice_then_fails() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts in the kernel, never answers
        port = silent.getsockname()[1]
        meta = EmbeddedMetadata()
        meta.publish(SegmentDescriptor(name="mute", engine_id="mute", host_id="elsewhere",
                                       address=f"127.0.0.1:{port}", size=1 << 20))
        cfg = TransferConfig(transports=("tcp",), connect_timeout_s=0.2)
        with TransferEngine(cfg, metadata=meta) as eng:
            t0 = time.monotonic()
            st = eng.wait(eng.submit([TransferRequest(OpCode.WRITE, b"x", "mute", 0)]), 5)
            elapsed = time.monotonic() - t0
    assert st.status == TransferStatus.FAILED
    assert st.requests[0].error == f"handshake with peer at 127.0.0.1:{port} failed: timed out"
    assert 0.4 <= elapsed < 2.0  # two attempts of 0.2 s each


def test_the_spin_window_is_chosen_at_start_up_not_in_a_handshake(monkeypatch) -> None:
    """With ``spin_us`` auto the first choice measures the machine (seconds on a loaded host):
    the server makes it when it starts, so no peer's handshake waits for it."""
    from yuebing.transfer.transport import tcp_server

    threads: list[str] = []
    real = tcp_server.window_s

    def recording(configured_us: int, reference_us: float) -> float:
        threads.append(threading.current_thread().name)
        return real(configured_us, reference_us)

    monkeypatch.setattr(tcp_server, "window_s", recording)
    meta = EmbeddedMetadata()
    main = threading.current_thread().name
    with TransferEngine(TransferConfig(engine_id="owner-w"), meta) as owner:
        owner.register_segment("w", size=4096)
        assert threads == [main]
        with TransferEngine(TransferConfig(transports=("tcp",), lanes=2), meta) as peer:
            peer.transfer([TransferRequest(OpCode.WRITE, b"w" * 64, "w", 0)])
        assert threads == [main, main]  # each server at its start, none in a connection's thread
