"""An instance's admin HTTP (``yuebing serve <role> --admin-port``) in a real process."""

from __future__ import annotations

import json
import urllib.request

from instance_procs import TINY, InstanceProc
from prometheus_client.parser import text_string_to_metric_families

from etcd_util import free_port


def test_instance_admin_health_and_metrics() -> None:
    port = free_port()
    p = InstanceProc("coupled", TINY, "--admin-port", str(port), "--num-blocks", "64")
    try:
        base = f"http://127.0.0.1:{port}"
        health = json.load(urllib.request.urlopen(base + "/health", timeout=5))
        assert health == {"ok": True, "instance_id": p.hello["instance_id"], "role": "coupled",
                          "control_address": p.address}
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        kinds = {s.name: (f.type, s.value) for f in text_string_to_metric_families(text)
                 for s in f.samples}
        assert kinds["yuebing_instance_kv_blocks_total"] == ("gauge", 64)
        assert kinds["yuebing_instance_requests_running"] == ("gauge", 0)
        assert kinds["yuebing_instance_preemptions_total"] == ("counter", 0)
        assert kinds["yuebing_instance_info"] == ("gauge", 1)
    finally:
        p.stop()
