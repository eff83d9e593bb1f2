"""``yuebing info``: what this installation has (version, torch, device, registered plug-ins)."""

from __future__ import annotations

import argparse
import json
import platform

from yuebing.cli.main import Command


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def _run(ns: argparse.Namespace) -> int:
    import yuebing

    info: dict[str, object] = {"yuebing": yuebing.__version__, "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
    except ImportError:
        info["torch"] = None
    if ns.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:10s} {v}")
    return 0


COMMANDS = [Command(("info",), "show versions and devices", _add, _run)]
