"""Entry point of the ``yuebing`` command.

Commands are contributed by the ``yuebing.cli.cmd_*`` modules, discovered at start-up, so each
package owns its own commands without editing this file. A module exposes ``COMMANDS``: a list
of `Command` (a path such as ``("bench", "transfer")``, a help line, a function adding its
arguments to an argparse parser, and the function run with the parsed namespace, returning an
exit code). Modules import their heavy dependencies inside ``run`` so ``yuebing --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import yuebing
from yuebing.core.errors import YuebingError


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _discover() -> list[Command]:
    import yuebing.cli as pkg

    commands: list[Command] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("cmd_"):
            module = importlib.import_module(f"yuebing.cli.{info.name}")
            commands.extend(module.COMMANDS)
    return commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yuebing", description="yuebing: KVCache-centric disaggregated LLM serving (Mooncake)")
    parser.add_argument("--version", action="version", version=f"yuebing {yuebing.__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {
        (): parser.add_subparsers(dest="command", metavar="COMMAND")}
    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {(): parser}
    for cmd in sorted(_discover(), key=lambda c: c.path):
        for depth in range(1, len(cmd.path)):
            prefix = cmd.path[:depth]
            if prefix in parsers and prefix not in groups:  # a command that has subcommands
                groups[prefix] = parsers[prefix].add_subparsers(
                    dest="_".join(prefix) + "_cmd", metavar="COMMAND")
            elif prefix not in parsers:
                sub = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} commands")
                parsers[prefix] = sub
                groups[prefix] = sub.add_subparsers(dest="_".join(prefix) + "_cmd",
                                                    metavar="COMMAND")
        p = groups[cmd.path[:-1]].add_parser(cmd.path[-1], help=cmd.help, description=cmd.help)
        cmd.add_args(p)
        p.set_defaults(_run=cmd.run)
        parsers[cmd.path] = p
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(ns.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = getattr(ns, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(ns) or 0)
    except YuebingError as e:
        print(f"yuebing: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
