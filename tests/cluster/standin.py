"""A stand-in role process for supervisor tests: ``python standin.py MODE [--ready PATH]``.

Modes: ``serve`` (write the ready file after ``--delay`` s, then sleep until SIGTERM), ``fail``
(print a message and exit 3 at once), ``never`` (never ready), ``stubborn`` (ready, prints and ignores
SIGTERM), ``parent`` (ready, starts a ``sleep`` grandchild whose pid it puts in the ready
file), ``shm`` (registers a 1 MiB shared-memory segment with a transfer engine; its file name in
the ready file), ``http`` (serves GET /health -> 200 on ``--port``, a
Conductor-like body whose view lists instance p0 from the 4th GET on), ``die-after`` (ready, then
exits 5 after ``--delay``).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import subprocess
import sys
import time


def ready(path: str, **info: object) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), **info}, f)
        os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("--ready", default="")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"standin {a.mode} pid {os.getpid()}", flush=True)
    time.sleep(a.delay if a.mode != "die-after" else 0)  # the stand-in's configured start-up delay
    if a.mode == "fail":
        print("standin: cannot bind 127.0.0.1:1 (permission denied)", flush=True)
        sys.exit(3)
    if a.mode == "never":
        time.sleep(3600)  # a role that never becomes ready
    if a.mode == "stubborn":
        signal.signal(signal.SIGTERM, lambda *_: print("standin: SIGTERM ignored", flush=True))
    extra: dict[str, object] = {}
    if a.mode == "parent":
        child = subprocess.Popen(["sleep", "3600"])
        extra["child"] = child.pid
    if a.mode == "shm":
        from yuebing.transfer import TransferConfig, TransferEngine

        eng = TransferEngine(TransferConfig(metadata="p2p"))
        eng.register_segment("standin", size=1 << 20)
        extra["shm"] = sorted(e for e in os.listdir("/dev/shm")
                              if e.startswith(f"yuebing-tx-{os.getpid()}-"))
    if a.mode == "http":
        seen = [0]

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                """/health: 200 with an empty view for the first 3 GETs, then with p0."""
                seen[0] += 1
                view = {"prefill": ["p0"] if seen[0] > 3 else []}
                body = json.dumps({"ready": seen[0] > 3, "instances": view}).encode()
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
                self.wfile.write(body)

        http.server.HTTPServer(("127.0.0.1", a.port), H).serve_forever()
    ready(a.ready, **extra)
    if a.mode == "die-after":
        time.sleep(a.delay)  # it dies this long after it was ready
        sys.exit(5)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
