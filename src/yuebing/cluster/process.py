"""One role's child process: spawn with its own log file, signal its process group, read its log.

Called by `yuebing.cluster.supervisor.Supervisor` (from the thread that owns the supervisor,
normally the main thread: a child's parent-death signal fires when the *thread* that forked it
exits, so children must be spawned from a thread that lives as long as the supervisor).

Every child runs in a new session (its own process group, so a terminal's Ctrl-C reaches only
the supervisor, which then stops the roles in order) and has ``PR_SET_PDEATHSIG = SIGKILL``:
if the supervisor dies without stopping it (``kill -9``), the kernel kills the child; its
shared-memory segments are then swept by the next transfer engine started on the host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from yuebing.ops.pgroup import kill_group
from yuebing.ops.procs import die_with_parent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleSpec:
    """How to run one role: its unique ``name`` (``store-master``, ``prefill-0``...), the full
    command line, extra environment, and whether the watch loop restarts it when it dies."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    restart: bool = True

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"role name {self.name!r} must be a plain file-name-safe word")
        if not self.argv:
            raise ValueError(f"role {self.name}: empty command line")


class RoleProcess:
    """A running (or exited) child of one `RoleSpec`; output goes to ``log_path`` (appended,
    so a restarted role keeps its earlier lines)."""

    def __init__(self, spec: RoleSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.started_at = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        with open(log_path, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} start: "
                      f"{' '.join(spec.argv)}\n".encode())
            out.flush()
            parent = os.getpid()
            self.proc = subprocess.Popen(
                list(spec.argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=lambda: die_with_parent(parent, signal.SIGKILL))
        self.pid = self.proc.pid
        log.info("started %s (pid %d), log %s", spec.name, self.pid, log_path)

    @property
    def name(self) -> str:
        return self.spec.name

    def poll(self) -> int | None:
        """The exit code if the child has exited (negative: killed by that signal)."""
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (itself and anything it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill_group(self, wait_s: float = 10.0) -> int | None:
        """SIGKILL the child's whole process group, wait up to ``wait_s`` until none of its
        processes runs (`ops.pgroup.kill_group`: a signalled process exits only once
        scheduled), then reap the child; its exit code (None: it still runs)."""
        kill_group(self.pid, wait_s)
        return self.wait(wait_s)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 20, max_bytes: int = 16384) -> str:
        """The last ``lines`` lines of the role's log (for error messages)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_bytes))
                data = f.read()
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def describe_exit(code: int) -> str:
    """``exit code 3`` / ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

