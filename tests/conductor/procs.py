"""Real processes for end-to-end tests: ``yuebing serve prefill|decode|coupled`` instances and
``yuebing serve conductor`` on 127.0.0.1, each with its own log; `Cluster` starts them in
order, waits for readiness and stops (or kills) every one it started."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from harness import request

from cli_procs import CliProc

TINY = "dummy:preset=tiny"


class Proc(CliProc):
    """One ``yuebing serve <role> ...`` process that writes a ready file (log in ``workdir``)."""

    def __init__(self, name: str, args: list[str], workdir: Path, timeout_s: float) -> None:
        super().__init__(["-v", "serve", *args], name=name, workdir=workdir, timeout_s=timeout_s,
                         log_tail=6000)


class Cluster:
    """Instances (``roles``: e.g. ["prefill", "prefill", "decode"], each optionally with its
    own flags: "prefill --layers 0:2") and a Conductor."""

    def __init__(self, roles: list[str], model: str = TINY, conductor_args: tuple[str, ...] = (),
                 instance_args: tuple[str, ...] = (), timeout_s: float = 240.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="yb-conductor-e2e-"))
        self.procs: dict[str, Proc] = {}
        try:
            for i, spec in enumerate(roles):  # "prefill --layers 0:2": a role and its flags
                role, *flags = spec.split()
                name = f"{role}-{i}"
                self.procs[name] = Proc(name, [role, "--model", model, "--instance-id", name,
                                               "--report-hz", "20", "--no-startup-profile",
                                               *instance_args, *flags],
                                        self.dir, timeout_s)
            addresses = ",".join(p.info["control_address"] for p in self.procs.values())
            self.conductor = Proc("conductor", ["conductor", "--model", model, "--port", "0",
                                                "--instances", addresses, *conductor_args],
                                  self.dir, timeout_s)
            self.procs["conductor"] = self.conductor
            self.url = str(self.conductor.info["url"])
            self.wait_ready(len(roles), timeout_s)
        except BaseException:
            self.stop()
            raise

    def health(self) -> dict[str, Any]:
        return request(self.url, "GET", "/health")[1]  # type: ignore[no-any-return]

    def wait_ready(self, n: int, timeout_s: float = 60.0) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if sum(len(v) for v in h["instances"].values()) == n:
                return h
            if time.monotonic() > end:
                raise RuntimeError(f"instances did not join: {h}\n{self.conductor.log()}")
            time.sleep(0.1)

    def free_blocks(self, name: str) -> int:
        return int(self.health()["load"][name]["free_blocks"])

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()
