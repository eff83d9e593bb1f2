"""Entry points of the instance processes: ``run_<role>(config)`` builds the role and serves
until SIGINT/SIGTERM (``yuebing serve prefill|decode|coupled``, `yuebing.cluster`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from yuebing.core.auth import adopt_cluster_token
from yuebing.instance.base import Instance, serve_instance
from yuebing.instance.config import InstanceConfig

log = logging.getLogger(__name__)


def build_instance(cfg: InstanceConfig) -> Instance:
    """The role object for ``cfg.role`` (engine loaded, not yet serving)."""
    from yuebing.instance.coupled import CoupledInstance
    from yuebing.instance.decode import DecodeInstance
    from yuebing.instance.prefill import PrefillInstance

    cls = {"prefill": PrefillInstance, "decode": DecodeInstance,
           "coupled": CoupledInstance}[cfg.role]
    return cls(cfg)


def run_instance(cfg: InstanceConfig) -> int:
    """Build the role, serve its admin HTTP (``--admin-port``) beside the control loop."""
    from yuebing.instance.admin import admin_server

    adopt_cluster_token(cfg.cluster_token)  # the store client and peer clients dial with it
    inst = build_instance(cfg)
    admin = admin_server(inst).start() if cfg.admin_port else None
    try:
        asyncio.run(serve_instance(inst))
    finally:
        if admin is not None:
            admin.close()
    return 0


def run_prefill(cfg: InstanceConfig) -> int:
    return run_instance(dataclasses.replace(cfg, role="prefill"))


def run_decode(cfg: InstanceConfig) -> int:
    return run_instance(dataclasses.replace(cfg, role="decode"))


def run_coupled(cfg: InstanceConfig) -> int:
    return run_instance(dataclasses.replace(cfg, role="coupled"))
