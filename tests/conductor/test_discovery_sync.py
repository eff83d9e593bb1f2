"""The Conductor's instances from etcd discovery (``--etcd``) when keys vanish: a real etcd,
fake instances published in it as the real ones publish themselves (a key on a lease kept
alive by `Publication`).

etcd deletes every key whose lease it did not see refreshed in time — all of them at once
when etcd itself was stopped (or stalled) for longer than the lease (issue 16's etcd faults).
The instances serve on and publish again within a third of the lease; the Conductor must not
drop them meanwhile (it did: every request in flight failed with "left discovery" and new ones
got 503 until they were listed again). An instance that leaves discovery and stops answering
is still let go.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from fake_instance import FakeLoop
from harness import MODEL, ConductorThread, request, response, sse_events

from etcd_util import EtcdServer, find_etcd
from yuebing.cluster.discovery import Discovery, Publication
from yuebing.protocol.instance import Role

pytestmark = [pytest.mark.etcd,
              pytest.mark.skipif(find_etcd() is None, reason="etcd binary not installed "
                                 "(scripts/install_test_servers.sh)")]


@pytest.fixture
def fl() -> Iterator[FakeLoop]:
    loop = FakeLoop()
    yield loop
    loop.close()


def _health(c: ConductorThread) -> dict[str, list[str]]:
    return request(c.url, "GET", "/health")[1]["instances"]


def _until(what: str, cond: object, timeout_s: float = 15.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_instances_stay_while_etcd_drops_their_keys_and_go_once_gone(fl: FakeLoop) -> None:
    p0 = fl.add(Role.PREFILL, "p0")
    d0 = fl.add(Role.DECODE, "d0", step_s=0.05)
    with EtcdServer() as etcd:
        disc = Discovery(etcd.url, "sync")

        def publish() -> dict[str, Publication]:
            return {f.name: disc.publish("instances", f.name, {"control_address": f.address})
                    for f in (p0, d0)}

        pubs = publish()
        c = ConductorThread(etcd=etcd.url, cluster="sync", heartbeat_timeout_s=2.0)
        try:
            _until("joined", lambda: _health(c) == {"prefill": ["p0"], "decode": ["d0"],
                                                      "coupled": [], "stage": []})
            events: list[object] = []
            stream = threading.Thread(target=lambda: events.extend(sse_events(response(
                c.url, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3],
                                           "max_tokens": 60, "stream": True})[1])))
            stream.start()  # 60 tokens at 50 ms: ~3 s in flight
            _until("streaming", lambda: len(events) > 1)
            for p in pubs.values():  # their keys go, as etcd drops leases it saw no refresh
                p.close()            # of (the instances publish again a moment later)
            assert disc.list("instances") == {}
            seen: list[dict[str, list[str]]] = []
            end = time.monotonic() + 2.0
            while time.monotonic() < end:  # the watch (every 0.5 s) sees the empty list
                seen.append(_health(c))
                time.sleep(0.1)
            stream.join(30)
            assert events and events[-1] == "[DONE]", events[-3:]
            assert not [e for e in events[:-1] if "error" in e], events  # type: ignore[operator]
            assert all(h["prefill"] == ["p0"] and h["decode"] == ["d0"] for h in seen), seen
            status, body = request(c.url, "POST", "/v1/completions",
                                   {"model": MODEL, "prompt": [4, 5], "max_tokens": 2})
            assert status == 200, body
            pubs = publish()

            pubs["d0"].close()  # d0 leaves discovery and is gone: the Conductor lets go
            fl.call(d0.silence)
            _until("d0 let go", lambda: _health(c)["decode"] == [])
            _until("d0 discarded", lambda: c.conductor.cluster.by_address.get(d0.address)
                   is None)
        finally:
            c.stop()
            for p in pubs.values():
                p.close()
