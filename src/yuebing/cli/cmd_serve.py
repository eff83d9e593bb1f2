"""``yuebing serve`` and its roles. Thin: each command's flags and logic live in its package.

- ``yuebing serve`` (no role): every role of a one-host cluster under a supervisor
  (`yuebing.cluster.cli`).
"""

from __future__ import annotations

import argparse

from yuebing.cli.main import Command


def _add_all(p: argparse.ArgumentParser) -> None:
    from yuebing.cluster.cli import add_serve_args

    add_serve_args(p)


def _run_all(ns: argparse.Namespace) -> int:
    from yuebing.cluster.cli import run_serve_command

    return run_serve_command(ns)


COMMANDS = [
    Command(("serve",), "serve an OpenAI-compatible API: store, prefill + decode (or coupled) "
            "instances and the Conductor on this host, stopped together by Ctrl-C",
            _add_all, _run_all),
]
