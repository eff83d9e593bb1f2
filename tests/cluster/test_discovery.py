"""etcd discovery against a real etcd (tests/etcd_util.py): publish with a lease, list, watch,
close deletes, a crashed publisher's key expires, a lost lease is renewed, bad input."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from etcd_util import etcd_server  # noqa: F401 - fixture
from yuebing.cluster.discovery import Discovery, DiscoveryError, parse_etcd_url

pytestmark = pytest.mark.etcd


def wait_until(cond, timeout_s: float = 15.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


def test_publish_list_close(etcd_server) -> None:  # noqa: F811
    d = Discovery(etcd_server.url, cluster="t1")
    hello = {"instance_id": "p0", "role": 0, "control_address": "tcp://10.0.0.1:5000"}
    with d.publish("instances", "p0", hello, ttl_s=2) as pub:
        d.publish("instances", "d0", {"instance_id": "d0"}, ttl_s=2).close()
        assert d.list("instances") == {"p0": hello}
        assert pub.key == "/yuebing/t1/instances/p0"
        assert Discovery(etcd_server.url, cluster="other").list("instances") == {}
        time.sleep(2.5)  # longer than the TTL: the keep-alive holds it
        assert d.list("instances") == {"p0": hello}
    assert d.list("instances") == {}


def test_crashed_publisher_key_expires(etcd_server) -> None:  # noqa: F811
    script = ("import sys, time\nfrom yuebing.cluster.discovery import Discovery\n"
              "Discovery(sys.argv[1], 't2').publish('instances', 'x', {'a': 1}, ttl_s=1)\n"
              "print('up', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, etcd_server.url],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        d = Discovery(etcd_server.url, cluster="t2")
        assert d.list("instances") == {"x": {"a": 1}}
        proc.kill()
        wait_until(lambda: d.list("instances") == {})
    finally:
        proc.kill()
        proc.wait(10)


def test_lost_lease_is_taken_again(etcd_server) -> None:  # noqa: F811
    d = Discovery(etcd_server.url, cluster="t3")
    with d.publish("conductor", "c0", {"url": "http://h:8000"}, ttl_s=1) as pub:
        pub._lease.revoke()  # what etcd does to a lease it did not hear from in time
        assert d.list("conductor") == {}
        wait_until(lambda: d.list("conductor") == {"c0": {"url": "http://h:8000"}})


def test_watch_sees_changes(etcd_server) -> None:  # noqa: F811
    d = Discovery(etcd_server.url, cluster="t4")
    seen: list[dict] = []
    got = threading.Event()

    def on_change(snapshot: dict) -> None:
        seen.append(snapshot)
        got.set()

    w = d.watch("instances", on_change, interval_s=0.05)
    try:
        wait_until(lambda: seen == [{}])
        pub = d.publish("instances", "p1", {"n": 1})
        wait_until(lambda: seen[-1] == {"p1": {"n": 1}})
        pub.close()
        wait_until(lambda: seen[-1] == {})
        assert seen == [{}, {"p1": {"n": 1}}, {}]
    finally:
        w.close()


def test_non_json_values_are_skipped_and_store_master_read(etcd_server) -> None:  # noqa: F811
    d = Discovery(etcd_server.url, cluster="t5")
    d.client.put("/yuebing/t5/instances/bad", "not json")
    d.client.put("/yuebing/t5/instances/list", "[1, 2]")
    assert d.list("instances") == {}
    assert d.store_master() == ""
    d.client.put("/yuebing/store/t5/leader", "tcp://10.0.0.2:50151")
    assert d.store_master() == "tcp://10.0.0.2:50151"


def test_wait_for(etcd_server) -> None:  # noqa: F811
    d = Discovery(etcd_server.url, cluster="t6")
    with d.publish("instances", "a", {"role": 0}), d.publish("instances", "b", {"role": 1}):
        assert set(d.wait_for("instances", 2, timeout_s=5)) == {"a", "b"}
        with pytest.raises(DiscoveryError, match="only 1 of 2 instances"):
            d.wait_for("instances", 2, 0.2, predicate=lambda v: v["role"] == 0)


def test_bad_input() -> None:
    for url in ("127.0.0.1:2379", "ftp://h:1", "http://h:2379/v3"):
        with pytest.raises(ValueError, match="--etcd must be an URL"):
            parse_etcd_url(url)
    assert parse_etcd_url("http://h") == ("http", "h", 2379)
    with pytest.raises(ValueError, match="cluster name 'a/b'"):
        Discovery("http://127.0.0.1:1", cluster="a/b")
    d = Discovery("http://127.0.0.1:1", timeout_s=0.5)
    with pytest.raises(ValueError, match="id ''"):
        d.publish("instances", "", {})
    with pytest.raises(ValueError, match="ttl_s must be"):
        d.publish("instances", "x", {}, ttl_s=0)
    with pytest.raises(ValueError, match="must be a dict"):
        d.publish("instances", "x", [1])  # type: ignore[arg-type]
    with pytest.raises(DiscoveryError, match="cannot list instances in etcd http://127.0.0.1:1"):
        d.list("instances")
    with pytest.raises(DiscoveryError, match="cannot publish instances/x"):
        d.publish("instances", "x", {})


def test_publish_with_retry_registers_once_etcd_is_back() -> None:
    """A role started while etcd is down (issue 16's etcd kill) registers once it is back
    (a plain publish raised, and ``yuebing serve prefill --etcd`` exited)."""
    from etcd_util import EtcdServer, find_etcd

    if find_etcd() is None:
        pytest.skip("etcd not installed (scripts/install_test_servers.sh)")
    with EtcdServer() as etcd:
        d = Discovery(etcd.url, cluster="t7", timeout_s=0.5)
        etcd.kill()  # down; restarted below at the same address with its data
        with pytest.raises(DiscoveryError, match="cannot publish instances/x"):
            d.publish("instances", "x", {"n": 0})
        with d.publish("instances", "late", {"n": 1}, ttl_s=3, retry=True) as pub:
            etcd.start()
            wait_until(lambda: d.list("instances") == {"late": {"n": 1}})
            assert pub.key == "/yuebing/t7/instances/late"
        assert d.list("instances") == {}  # closed: its lease revoked


@pytest.mark.parametrize("race", ["first-write", "re-lease"])
def test_close_during_a_write_leaves_no_key(etcd_server, race: str) -> None:  # noqa: F811
    """`close` while the thread's write is under way — its first write after etcd was
    unreachable at publish (``retry``), or its write under a new lease after the old one was
    lost — and outlasts close's wait for the thread: the key is gone once that write lands
    (it used to stay until its new lease's TTL)."""
    d = Discovery(etcd_server.url, cluster=f"t8-{race}")
    real_put = d.client.put
    entered, gate = threading.Event(), threading.Event()
    calls = []

    def put(*args, **kw):
        calls.append(args)
        if race == "first-write" and len(calls) == 1:
            raise ConnectionError("etcd unreachable")  # publish with retry keeps trying
        if race == "re-lease" and len(calls) == 1:
            return real_put(*args, **kw)
        entered.set()
        assert gate.wait(30)
        return real_put(*args, **kw)

    d.client.put = put
    pub = d.publish("instances", "x", {"n": 1}, ttl_s=2, retry=True)
    if race == "re-lease":
        assert d.list("instances") == {"x": {"n": 1}}
        pub._lease.revoke()  # lost: the thread takes a new lease and writes again
    try:
        assert entered.wait(15), "the publication thread did not write"
        pub.close()  # its wait for the thread (ttl_s) ends before the write does
        gate.set()
        pub._thread.join(15)
        assert not pub._thread.is_alive()
        assert d.list("instances") == {}
    finally:
        gate.set()
        pub.close()


def test_an_instance_publishes_its_hello_as_a_conductor_reads_it(etcd_server) -> None:  # noqa: F811
    import msgspec

    from yuebing.protocol.instance import Hello, Role

    hello = Hello(seq=0, instance_id="p0", role=Role.PREFILL, model="m", fingerprint="fp",
                  host="h", control_address="tcp://10.0.0.1:5000", kv_segment="s",
                  block_size=16, store_block_tokens=256, num_blocks=64, max_model_len=4096,
                  incarnation="i", layers="0:15", group="g")
    d = Discovery(etcd_server.url, cluster="t3")
    with d.publish_instance("p0", hello) as pub:
        assert pub.key == "/yuebing/t3/instances/p0"
        assert msgspec.convert(d.list("instances")["p0"], Hello) == hello
