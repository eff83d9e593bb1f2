"""Two "hosts" in network namespaces created here, joined by a veth pair: host A runs etcd and
``yuebing serve --etcd ... --prefill 1 --decode 0`` (store, a prefill instance, the Conductor);
host B runs ``yuebing serve decode --etcd ...`` alone. Each host has its own hostname (a UTS
namespace), so the transfer engine sees two machines and moves KV over TCP. The Conductor
finds the decode instance through etcd, and a chat request from host B is served end to end.
Both hosts bind beyond loopback, so they share a cluster token (given in the environment) and
the API takes an API key.
Needs root (``ip netns``, ``unshare``) and etcd; skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from serve_util import Serve, procs_mentioning

from etcd_util import find_etcd

pytestmark = [pytest.mark.slow, pytest.mark.etcd]
TOKEN = {"YUEBING_CLUSTER_TOKEN": "two-hosts-token"}
API_KEY = "two-hosts-key"


@dataclass
class Hosts:
    a: str
    b: str
    ip_a: str
    ip_b: str

    def run_in(self, ns: str, hostname: str) -> list[str]:
        """Command prefix: run inside ``ns`` with its own hostname."""
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                f'hostname {hostname} && exec "$@"', "sh"]


def _sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("two-host test needs root with `ip` and `unshare` (network namespaces)")
    if find_etcd() is None:
        pytest.skip("etcd not installed (scripts/install_test_servers.sh)")
    tag = f"yb{os.getpid() % 100000}"
    h = Hosts(f"{tag}a", f"{tag}b", f"10.213.{os.getpid() % 250}.1",
              f"10.213.{os.getpid() % 250}.2")
    probe = _sh("ip", "netns", "add", h.a)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {probe.stderr.strip()}")
    try:
        _sh("ip", "netns", "add", h.b).check_returncode()
        _sh("ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name",
            f"{tag}vb").check_returncode()
        for ns, dev, ip in ((h.a, f"{tag}va", h.ip_a), (h.b, f"{tag}vb", h.ip_b)):
            _sh("ip", "link", "set", dev, "netns", ns).check_returncode()
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev).check_returncode()
            _sh("ip", "-n", ns, "link", "set", dev, "up").check_returncode()
            _sh("ip", "-n", ns, "link", "set", "lo", "up").check_returncode()
        yield h
    finally:
        _sh("ip", "netns", "del", h.a)  # deletes the veth pair with it
        _sh("ip", "netns", "del", h.b)


def start_etcd(h: Hosts, data: Path) -> subprocess.Popen[bytes]:
    url = f"http://{h.ip_a}:2379"
    peer = f"http://{h.ip_a}:2380"
    etcd = find_etcd()
    assert etcd is not None
    log = open(data.parent / "etcd.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        ["ip", "netns", "exec", h.a, etcd, "--name", "a", "--data-dir", str(data),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"a={peer}", "--heartbeat-interval", "50",
         "--election-timeout", "500", "--log-level", "warn", "--logger", "zap"],
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    for _ in range(200):
        r = _sh("ip", "netns", "exec", h.b, sys.executable, "-c",
                "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=1)"
                ".read().decode())", url + "/health")
        if '"health":"true"' in r.stdout:
            return proc
        assert proc.poll() is None, (data.parent / "etcd.log").read_text()
        time.sleep(0.1)
    raise AssertionError("etcd in host A did not become healthy")


CLIENT = """
import json, sys, time, urllib.request, urllib.error
body = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
                   "messages": [{"role": "user", "content": "What is the capital of France?"}]})
end = time.monotonic() + 120
while True:
    req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", data=body.encode(),
                                 headers={"content-type": "application/json",
                                          "authorization": "Bearer " + sys.argv[2]})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            print(r.read().decode()); break
    except urllib.error.HTTPError as e:  # 503/429 until the Conductor sees the decode
        if time.monotonic() > end: print(e.code, e.read().decode()); sys.exit(1)
        time.sleep(0.5)
"""


def test_two_hosts_through_etcd(hosts: Hosts, tmp_path: Path) -> None:
    h = hosts
    etcd_url = f"http://{h.ip_a}:2379"
    etcd = start_etcd(h, tmp_path / "etcd-data")
    a = b = None
    try:
        a = Serve(["serve", "--etcd", etcd_url, "--advertise-host", h.ip_a, "--host", h.ip_a,
                   "--port", "8000", "--prefill", "1", "--decode", "0", "--store-port", "50151",
                   "--store-dram", "64MiB", "--log-dir", str(tmp_path / "a"),
                   "--api-key", API_KEY], prefix=h.run_in(h.a, "yb-host-a"), env=TOKEN)
        a.wait_for("Ctrl-C stops every process.")
        assert f"store master: tcp://{h.ip_a}:50151" in a.output()
        b = Serve(["serve", "decode", "--etcd", etcd_url, "--host", h.ip_b,
                   "--instance-id", "decode-b", "--store-master", f"tcp://{h.ip_a}:50151",
                   "--ready-file", str(tmp_path / "b.ready.json")],
                  prefix=h.run_in(h.b, "yb-host-b"), env=TOKEN)
        for _ in range(1200):
            if (tmp_path / "b.ready.json").exists() or b.proc.poll() is not None:
                break
            time.sleep(0.1)
        hello = json.loads((tmp_path / "b.ready.json").read_text())
        assert hello["control_address"].startswith(f"tcp://{h.ip_b}:")
        out = subprocess.run(["ip", "netns", "exec", h.b, sys.executable, "-c", CLIENT,
                              f"http://{h.ip_a}:8000", API_KEY], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr + a.output()
        reply = json.loads(out.stdout)
        assert reply["choices"][0]["message"]["content"]
        assert reply["usage"]["yuebing"]["prefill_instance"] == "prefill-0"
        assert reply["usage"]["yuebing"]["decode_instance"] == "decode-b"
    finally:
        for proc in (b, a):
            if proc is not None:
                try:
                    proc.stop(signal.SIGINT, timeout_s=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        etcd.terminate()
        etcd.wait(10)
    assert a is not None and a.proc.returncode == 0, a.output()
    assert procs_mentioning(str(tmp_path)) == []
