"""``yuebing engine build-kernels``: compile the engine's native CPU kernels ahead of time (the
engine otherwise builds them on first use), so the first request does not pay the compile."""

from __future__ import annotations

import argparse
import json
import time

from yuebing.cli.main import Command


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def _run(ns: argparse.Namespace) -> int:
    from yuebing.engine import native

    t0 = time.perf_counter()
    result = native.load()
    info = {"ok": result.ok, "library": str(result.path) if result.path else None,
            "error": result.error, "seconds": round(time.perf_counter() - t0, 2),
            "key": native.build_key()}
    if ns.json:
        print(json.dumps(info))
    elif result.ok:
        print(f"native kernels ready: {result.path} ({info['seconds']} s)")
    else:
        print(f"error: {result.error}")
    return 0 if result.ok else 1


COMMANDS = [Command(("engine", "build-kernels"), "compile the engine's native CPU kernels now "
                    "(else built on first use)", _add, _run)]
