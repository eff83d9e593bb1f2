"""A storage node's admin HTTP (``yuebing store node --admin-port``) in a real process."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from store_procs import store_cluster

from etcd_util import free_port


def test_node_admin_health_and_metric_types() -> None:
    port = free_port()
    with store_cluster("adm", dram="4MiB", node_args=("--admin-port", str(port))) as (_, nd):
        assert nd.info["admin"] == port
        base = f"http://127.0.0.1:{port}"
        health = json.load(urllib.request.urlopen(base + "/health", timeout=5))
        assert health["ok"] and health["name"] == "adm" and health["dram"] == nd.info["dram"]
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        kinds = {s.name: (f.type, s.value) for f in text_string_to_metric_families(text)
                 for s in f.samples}
        assert kinds["yuebing_store_node_dram_bytes"] == ("gauge", 4 << 20)
        assert kinds["yuebing_store_node_tasks_done_total"][0] == "counter"
