"""``yuebing store master``, ``yuebing store node`` and ``yuebing bench store``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading

from yuebing.cli.main import Command
from yuebing.core.config import add_config_args, config_from_args
from yuebing.core.errors import StoreError
from yuebing.store.config import ClientConfig, MasterConfig, NodeConfig

log = logging.getLogger(__name__)


def _on_term(stop: object) -> None:
    def handler(signum: int, frame: object) -> None:
        stop()  # type: ignore[operator]

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _write_ready(path: str, data: dict[str, object]) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)


def _add_master(p: argparse.ArgumentParser) -> None:
    add_config_args(p, MasterConfig)
    p.add_argument("--ready-file", default="", help="write {address, events, admin} JSON here")


def _run_master(ns: argparse.Namespace) -> int:
    from yuebing.store.master.admin import admin_server
    from yuebing.store.master.service import MasterService

    cfg = config_from_args(MasterConfig, ns)
    try:
        svc = MasterService(cfg)
    except OSError as e:  # its RPC port or local socket taken, say: one line, not a traceback
        raise StoreError(f"cannot start the master on {cfg.rpc_address}: {e}") from e
    admin = admin_server(svc, cfg.admin_host, cfg.admin_port).start() if cfg.admin_port else None
    _on_term(svc.stop)
    _write_ready(ns.ready_file, {"address": svc.address, "events": svc.events_address,
                                 "admin": admin.port if admin else 0, "pid": os.getpid()})
    print(f"store master on {svc.address}" + (f", admin {admin.url}" if admin else ""),
          flush=True)
    try:
        svc.serve()
    finally:
        if admin is not None:
            admin.close()
    return 0


NODE_CLIENT_FIELDS = ("master", "client_id", "rpc_timeout_s", "heartbeat_s", "failover_s",
                      "transfer_timeout_s", "local_socket")
"""The `ClientConfig` fields a storage node uses (its master connection, migration writes);
the put/get ones (replicas, checksums, reserve-ahead, ...) are not offered as its flags."""


def _add_node(p: argparse.ArgumentParser) -> None:
    from yuebing.transfer import TransferConfig

    add_config_args(p, NodeConfig)
    add_config_args(p, ClientConfig, only=NODE_CLIENT_FIELDS)
    add_config_args(p, TransferConfig, prefix="tx_")
    p.add_argument("--ready-file", default="", help="write {dram, ssd, admin} JSON here")
    p.add_argument("--drain-s", type=float, default=2.0,
                   help="on SIGTERM: drain every segment and wait up to this many seconds "
                        "for the master to migrate the values only this node holds to other "
                        "nodes and for readers' leases on them to end before unmounting "
                        "(values still only here then are lost)")


def _run_node(ns: argparse.Namespace) -> int:
    from yuebing.store.node.admin import admin_server
    from yuebing.store.node.service import StorageNode
    from yuebing.transfer import TransferConfig

    cfg = config_from_args(NodeConfig, ns)
    node = StorageNode(cfg, config_from_args(ClientConfig, ns),
                       config_from_args(TransferConfig, ns, prefix="tx_",
                                        metadata=getattr(ns, "tx_metadata", None) or "p2p"))
    admin = admin_server(node, cfg.admin_host, cfg.admin_port) if cfg.admin_port else None
    _on_term(lambda: _stopping(node, ns.drain_s))
    try:
        if admin is not None:
            admin.start()
        node.mount()
        _write_ready(ns.ready_file, {"dram": node.dram_name, "ssd": node.ssd_name,
                                     "admin": admin.port if admin else 0, "pid": os.getpid()})
        print(f"store node {node.name}: {node.dram_name}"
              + (f" + {node.ssd_name}" if node.ssd_name else ""), flush=True)
        node.serve()
    finally:
        try:
            left = node.drain(ns.drain_s)
        except Exception:  # noqa: BLE001 - still unmount and release the segments below
            log.exception("node %s: drain failed; unmounting anyway", node.name)
        else:
            if left:
                log.error("node %s: unmounting with %s values only here (lost)", node.name,
                          left if left > 0 else "an unknown number of")
        node.close()
        if admin is not None:
            admin.close()
    return 0


STOP_WATCHDOG_S = 10.0
"""A node told to stop exits at most this long after its ``--drain-s``, whatever happens."""


def _stopping(node: object, drain_s: float) -> None:
    """SIGTERM/SIGINT of a node: stop serving, bound every master call by ``drain_s``
    (`StorageNode.stop`), and arm a watchdog that ends the process if the shutdown still
    runs ``STOP_WATCHDOG_S`` past that (a stuck call must not keep a stopped node alive)."""
    node.stop(drain_s)  # type: ignore[attr-defined]

    def overran() -> None:
        log.error("node did not finish stopping within --drain-s %.1f + %.0fs; exiting now",
                  drain_s, STOP_WATCHDOG_S)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(drain_s + STOP_WATCHDOG_S, overran)
    timer.daemon = True
    timer.start()


def _add_bench(p: argparse.ArgumentParser) -> None:
    from yuebing.store.bench import add_bench_args

    add_bench_args(p)


def _run_bench(ns: argparse.Namespace) -> int:
    from yuebing.store.bench import run_bench

    return run_bench(ns)


COMMANDS = [
    Command(("store", "master"), "run a store master (metadata, allocation, HA)",
            _add_master, _run_master),
    Command(("store", "node"), "run a storage node contributing DRAM (and SSD) segments",
            _add_node, _run_node),
    Command(("bench", "store"), "benchmark the store (put/get/batch/zero-copy, metadata ops)",
            _add_bench, _run_bench),
]
