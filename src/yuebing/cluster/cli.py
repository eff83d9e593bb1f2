"""Flags of ``yuebing serve`` (no role) and their turning into a `ServeConfig`.

Called by ``yuebing.cli.cmd_serve``. The all-in-one command offers its own flags (`ServeConfig`,
`SupervisorConfig`) plus every flag of ``yuebing serve conductor`` and of ``yuebing serve
prefill`` (the instances' flags) except those it sets itself for each child (addresses, ids,
discovery, ready files). The role flags are taken from the roles' own parsers (found through the
CLI's command registry), so they never drift; the values a user gives are forwarded to each
child as the same flags (`forward_args`) and validated again by the role itself.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from yuebing.cluster.config import SupervisorConfig
from yuebing.cluster.serve import ServeConfig, run_serve
from yuebing.core.config import add_config_args, config_from_args
from yuebing.core.errors import ConfigError

log = logging.getLogger(__name__)

SERVE_FIELDS = ("prefill", "decode", "coupled", "host", "port", "advertise_host", "etcd",
                "cluster", "store", "store_dram", "store_port", "cluster_token", "engine")

MANAGED = {
    "conductor": {"--host", "--port", "--instances", "--etcd", "--cluster", "--store-events",
                  "--store-admin", "--ready-file", "--cluster-token"},
    "instance": {"--instance-id", "--host", "--advertise-host", "--control-port", "--role",
                 "--store-master", "--etcd", "--cluster", "--ready-file", "--cluster-token",
                 "--admin-host", "--admin-port"},
}
"""Flags of a role that the all-in-one sets itself for each child (not offered to the user;
the cluster token reaches every child through its environment, never its command line)."""

ROLE_COMMANDS = {"conductor": ("serve", "conductor"), "instance": ("serve", "prefill")}


def role_parser(path: tuple[str, ...]) -> argparse.ArgumentParser | None:
    """A fresh parser with the flags of the registered command ``path`` (None if absent)."""
    from yuebing.cli.main import _discover

    for cmd in _discover():
        if cmd.path == path:
            p = argparse.ArgumentParser(prog="yuebing " + " ".join(path), add_help=False)
            cmd.add_args(p)
            return p
    return None


def _role_actions(parser: argparse.ArgumentParser | None) -> list[argparse.Action]:
    if parser is None:
        return []
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Add the all-in-one's flags to ``p`` (the ``serve`` command's parser)."""
    add_config_args(p, ServeConfig, only=SERVE_FIELDS)
    add_config_args(p, SupervisorConfig)
    actions = {role: _role_actions(role_parser(path)) for role, path in ROLE_COMMANDS.items()}
    instance_opts = {o for a in actions["instance"] if not set(a.option_strings)
                     & MANAGED["instance"] for o in a.option_strings}
    for role, title in (("conductor", "conductor flags (passed to `yuebing serve conductor`)"),
                        ("instance", "instance flags (passed to every prefill, decode and "
                                     "coupled instance)")):
        group = p.add_argument_group(title)
        for action in actions[role]:
            opts = set(action.option_strings)
            if opts & MANAGED[role] or opts & set(p._option_string_actions):
                continue  # set per child, or already offered (e.g. --model for both)
            if role == "conductor" and opts & instance_opts and action.help:
                action.help += "; also given to the instances"
            group._add_action(action)


def forward_args(role_parser_: argparse.ArgumentParser | None, role: str,
                 serve_parser_actions: dict[str, argparse.Action],
                 ns: argparse.Namespace) -> tuple[str, ...]:
    """The flags of ``role`` the user set on ``yuebing serve``, as that role's command line."""
    out: list[str] = []
    done: set[str] = set()  # dests given once (an alias such as --ttft-slo shares its dest)
    for action in _role_actions(role_parser_):
        opt = action.option_strings[0]
        if (set(action.option_strings) & MANAGED[role] or opt not in serve_parser_actions
                or action.dest in done):
            continue
        owner = serve_parser_actions[opt]
        value = getattr(ns, owner.dest, None)
        if value is None or value == action.default:
            continue
        done.add(action.dest)
        out += _format(action, opt, value)
    return tuple(out)


def _format(action: argparse.Action, opt: str, value: Any) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        return [opt if value else "--no-" + opt[2:]]
    if action.nargs == 0:  # store_true / store_const / count
        return [opt] * (value if isinstance(value, int) and not isinstance(value, bool) else 1)
    if isinstance(value, list | tuple):
        if action.nargs in ("*", "+") or isinstance(action.nargs, int):
            return [opt, *map(str, value)]
        return [opt, ",".join(map(str, value))]
    return [opt, str(value)]


def has_option_fn() -> Callable[[str, str], bool]:
    """``has_option(role, flag)`` for `ServePlan`: whether that role's command offers it."""
    cache: dict[str, set[str]] = {}

    def has(role: str, opt: str) -> bool:
        if role == "store":
            return True
        if role not in cache:
            p = role_parser(("serve", role))
            cache[role] = set(p._option_string_actions) if p is not None else set()
        return opt in cache[role]

    return has


def serve_config_from_args(ns: argparse.Namespace,
                           serve_actions: dict[str, argparse.Action]) -> ServeConfig:
    """Build the `ServeConfig` from the parsed flags of ``yuebing serve``: the conductor's
    and the instances' configs are built from the forwarded flags exactly as those roles
    build them, so a bad value fails here, before any process starts."""
    from yuebing.conductor.cli import conductor_config
    from yuebing.instance.config import InstanceConfig

    if ns.coupled and (ns.prefill is not None or ns.decode is not None):
        raise ConfigError("--coupled K replaces --prefill/--decode: give one or the other")
    parsers = {role: role_parser(path) for role, path in ROLE_COMMANDS.items()}
    args = {role: forward_args(parsers[role], role, serve_actions, ns) for role in parsers}
    role = "coupled" if ns.coupled else "prefill"
    return config_from_args(
        ServeConfig, ns, verbose=getattr(ns, "verbose", 0),
        supervisor=config_from_args(SupervisorConfig, ns),
        conductor_args=args["conductor"], instance_args=args["instance"],
        conductor=conductor_config(_parse(parsers["conductor"], args["conductor"])),
        instance=config_from_args(InstanceConfig, _parse(parsers["instance"],
                                                         args["instance"]), role=role))


def _parse(parser: argparse.ArgumentParser | None, args: tuple[str, ...]) -> argparse.Namespace:
    if parser is None:
        raise ConfigError("this installation lacks the serve role commands")
    return parser.parse_args(list(args))


def run_serve_command(ns: argparse.Namespace) -> int:
    """``yuebing serve``: parse into a `ServeConfig` and run `run_serve`."""
    probe = argparse.ArgumentParser(add_help=False)
    add_serve_args(probe)
    cfg = serve_config_from_args(ns, probe._option_string_actions)
    return run_serve(cfg, has_option_fn())
