"""Flags of ``yuebing serve conductor`` and their turning into a `ConductorConfig`.

Called by ``yuebing.cli.cmd_serve`` (and, through the command registry, by the all-in-one
``yuebing serve``, which offers and forwards these flags). `ConductorConfig`'s fields and the
policy's (`PolicyConfig`, less the two the Conductor derives) become flags; ``--prefill-policy``,
``--decode-policy``, ``--ttft-slo``, ``--tbt-slo`` and ``--heartbeat-timeout`` are short aliases of the ``-s``
flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection

from yuebing.conductor.config import ConductorConfig
from yuebing.conductor.policy import PolicyConfig
from yuebing.core.auth import adopt_cluster_token
from yuebing.core.config import add_config_args, config_args, config_from_args

POLICY_FIELDS_SET_BY_CONDUCTOR = ("block_tokens", "kv_bytes_per_token")
"""`PolicyConfig` fields the Conductor derives (``--store-block-tokens``, the model's shape)."""
POLICY_ALIASES = {"--prefill-policy": "prefill_selector", "--decode-policy": "decode_selector",
                  "--ttft-slo": "ttft_slo_s", "--tbt-slo": "tbt_slo_s",
                  "--heartbeat-timeout": "heartbeat_timeout_s"}


def conductor_fields() -> tuple[str, ...]:
    """The fields whose flags ``yuebing serve conductor`` offers (the Conductor's, then the
    policy's less the two the Conductor derives)."""
    return (*(f.name for f in dataclasses.fields(ConductorConfig) if f.name != "policy"),
            *(f.name for f in dataclasses.fields(PolicyConfig)
              if f.name not in POLICY_FIELDS_SET_BY_CONDUCTOR))


def add_conductor_args(p: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
    """The Conductor's flags (its fields in ``skip`` left out, with their aliases); with
    ``ready_file`` not in ``skip``, ``--ready-file`` too."""
    names = set(conductor_fields()) - set(skip)
    add_config_args(p, ConductorConfig, only=[f.name for f in dataclasses.fields(
        ConductorConfig) if f.name in names])
    add_config_args(p, PolicyConfig, only=[f.name for f in dataclasses.fields(PolicyConfig)
                                           if f.name in names
                                           and f.name not in POLICY_FIELDS_SET_BY_CONDUCTOR])
    for flag, dest in POLICY_ALIASES.items():
        if dest in names:
            p.add_argument(flag, dest=dest, default=None,
                           help=f"same as --{dest.replace('_', '-')}",
                           type=str if dest.endswith("selector") else float)
    if "ready_file" not in skip:
        p.add_argument("--ready-file", default="",
                       help="write {url, pid} JSON here once listening")


def conductor_args(cfg: ConductorConfig, skip: Collection[str] = ()) -> tuple[str, ...]:
    """The flags of ``yuebing serve conductor`` that rebuild ``cfg`` (fields in ``skip`` left
    out): what the all-in-one supervisor starts its Conductor with."""
    return (*config_args(cfg, skip=skip),
            *config_args(cfg.policy, skip=(*skip, *POLICY_FIELDS_SET_BY_CONDUCTOR)))


def conductor_config(ns: argparse.Namespace) -> ConductorConfig:
    block = getattr(ns, "store_block_tokens", None) or ConductorConfig.store_block_tokens
    policy = config_from_args(PolicyConfig, ns, block_tokens=block)
    return config_from_args(ConductorConfig, ns, policy=policy)


def run_conductor_command(ns: argparse.Namespace) -> int:
    from yuebing.conductor.server import run_conductor

    cfg = conductor_config(ns)
    adopt_cluster_token(cfg.cluster_token)  # its instance clients present it
    return run_conductor(cfg, ready_file=ns.ready_file)
