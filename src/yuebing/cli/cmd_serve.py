"""``yuebing serve`` and its roles. Thin: each command's flags and logic live in its package.

- ``yuebing serve`` (no role): every role of a one-host cluster under a supervisor
  (`yuebing.cluster.cli`).
- ``yuebing serve conductor``: the Conductor (`yuebing.conductor.cli`).
- ``yuebing serve prefill|decode|coupled``: one serving instance (`yuebing.instance.run`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from yuebing.cli.main import Command


def _add_all(p: argparse.ArgumentParser) -> None:
    from yuebing.cluster.cli import add_serve_args

    add_serve_args(p)


def _run_all(ns: argparse.Namespace) -> int:
    from yuebing.cluster.cli import run_serve_command

    return run_serve_command(ns)


def _add_conductor(p: argparse.ArgumentParser) -> None:
    from yuebing.conductor.cli import add_conductor_args

    add_conductor_args(p)


def _run_conductor(ns: argparse.Namespace) -> int:
    from yuebing.conductor.cli import run_conductor_command

    return run_conductor_command(ns)


def _add_instance(p: argparse.ArgumentParser) -> None:
    from yuebing.core.config import add_config_args, config_flags
    from yuebing.instance.config import InstanceConfig

    add_config_args(p, InstanceConfig, only=[n for n in config_flags(InstanceConfig)
                                             if n != "role"])


def _instance_runner(role: str) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        from yuebing.core.config import config_from_args
        from yuebing.instance.config import InstanceConfig
        from yuebing.instance.run import run_instance

        ns.role = role
        return run_instance(config_from_args(InstanceConfig, ns))
    return run


_ROLE_HELP = {
    "prefill": "one prefill instance: prefix from the KV pool, chunked prefill, KV streamed "
               "layer by layer to a decode instance",
    "decode": "one decode instance: reserved KV received in place, continuous batching",
    "coupled": "one coupled instance (the vLLM-like baseline): prefill and decode in one engine",
}

COMMANDS = [
    Command(("serve",), "serve an OpenAI-compatible API: store, prefill + decode (or coupled) "
            "instances and the Conductor on this host, stopped together by Ctrl-C",
            _add_all, _run_all),
    Command(("serve", "conductor"), "run the Conductor: OpenAI-compatible HTTP API in front of "
            "prefill/decode (or coupled) instances", _add_conductor, _run_conductor),
    *[Command(("serve", role), text, _add_instance, _instance_runner(role))
      for role, text in _ROLE_HELP.items()],
]
