"""Entry points of the instance processes: ``run_<role>(config)`` builds the role and serves
until SIGINT/SIGTERM (``yuebing serve prefill|decode|coupled``, `yuebing.cluster`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec

from yuebing.core.auth import adopt_cluster_token
from yuebing.instance.base import Instance, InstanceRole
from yuebing.instance.config import InstanceConfig
from yuebing.protocol.instance import Hello

log = logging.getLogger(__name__)
T = TypeVar("T")


def build_instance(cfg: InstanceConfig) -> Instance:
    """The host with its role for ``cfg.role`` (engine loaded, not yet serving)."""
    from yuebing.instance.coupled import CoupledRole
    from yuebing.instance.decode import DecodeRole
    from yuebing.instance.prefill import PrefillRole
    from yuebing.instance.stage import StageRole

    role: type[InstanceRole] = {"prefill": PrefillRole, "decode": DecodeRole,
                                "coupled": CoupledRole}[cfg.role]
    if cfg.engine.layers:
        role = StageRole  # a prefill of one layer range: a pipeline group's stage
    return Instance(cfg, role)


def run_instance(cfg: InstanceConfig) -> int:
    """Build the role, serve its admin HTTP (``--admin-port``) beside the control loop."""
    from yuebing.instance.admin import admin_server

    adopt_cluster_token(cfg.cluster_token)  # the store client and peer clients dial with it
    inst = build_instance(cfg)  # its start-up measurements run at the normal priority
    log.info("%s", cfg.priority.apply_self())  # lowers every thread the engine started too
    admin = admin_server(inst).start() if cfg.admin_port else None
    try:
        run_loop(serve_instance(inst), cfg.event_loop)
    finally:
        if admin is not None:
            admin.close()
    return 0


def run_loop(main: Coroutine[Any, Any, T], event_loop: str = "uvloop") -> T:
    """``asyncio.run(main)`` on the chosen loop implementation (`InstanceConfig.event_loop`):
    uvloop costs the control loop less CPU per frame, wake-up and timer than asyncio's."""
    if event_loop == "uvloop":
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


def run_prefill(cfg: InstanceConfig) -> int:
    return run_instance(dataclasses.replace(cfg, role="prefill"))


def run_decode(cfg: InstanceConfig) -> int:
    return run_instance(dataclasses.replace(cfg, role="decode"))


def run_coupled(cfg: InstanceConfig) -> int:
    return run_instance(dataclasses.replace(cfg, role="coupled"))


def write_ready_file(path: str, hello: Hello) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(hello))
    os.replace(tmp, path)


async def serve_instance(inst: Instance) -> None:
    """Start the control server, publish readiness, serve until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await inst.start()
    publication = None
    if inst.cfg.etcd:
        from yuebing.cluster.discovery import Discovery
        publication = Discovery(inst.cfg.etcd, inst.cfg.cluster).publish_instance(
            inst.instance_id, inst.hello())
    if inst.cfg.ready_file:
        write_ready_file(inst.cfg.ready_file, inst.hello())
    gc.freeze()  # start-up's objects (model, torch, modules) out of every later collection
    try:
        await inst.serve(stop)
    finally:
        if publication is not None:
            with contextlib.suppress(Exception):
                publication.close()
        await inst.close()
