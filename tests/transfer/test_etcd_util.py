"""The reusable etcd test helper really starts and stops a server."""

from __future__ import annotations

import json
import urllib.request

import pytest

from etcd_util import EtcdServer, find_etcd

pytestmark = pytest.mark.etcd


@pytest.mark.skipif(find_etcd() is None, reason="etcd not installed")
def test_etcd_server_starts_answers_and_stops() -> None:
    with EtcdServer() as etcd:
        with urllib.request.urlopen(etcd.url + "/version", timeout=2) as r:
            version = json.loads(r.read())
        assert version["etcdserver"].startswith("3.")
        proc = etcd.proc
        assert proc is not None and proc.poll() is None
    assert proc.poll() is not None
    assert etcd.proc is None
