"""Frozen configs of the cluster supervisor (`SupervisorConfig`).

The supervisor's flags (``yuebing serve --log-dir ... --restart ...``) are generated from this
class; the one-host cluster config that composes it with the roles' configs is
`yuebing.cluster.serve.ServeConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from yuebing.core.config import require

RESTART_POLICIES = ("on-failure", "never")


@dataclass(frozen=True)
class SupervisorConfig:
    """How the supervisor starts, watches and stops role processes."""

    log_dir: str = field(default="", metadata={
        "help": "directory of the roles' log files (one per role: store-master.log, "
                "prefill-0.log, conductor.log, ...); '' = a fresh yuebing-serve-* directory "
                "under the system temp directory, kept after exit"})
    ready_timeout_s: float = field(default=300.0, metadata={
        "help": "a role not ready this long after its start fails the start (the first start "
                "on a machine compiles the engine's kernels, ~30 s per process; the time a "
                "start-up profile measures on this host is not counted, up to an hour)"})
    stop_grace_s: float = field(default=10.0, metadata={
        "help": "on shutdown each role gets SIGTERM and this many seconds to exit before "
                "SIGKILL (a second Ctrl-C kills at once)"})
    restart: str = field(default="on-failure", metadata={
        "help": "what happens when a role dies after the cluster started: 'on-failure' "
                "restarts it (backoff 1, 2, 4 .. 30 s) unless it died more than "
                "--max-restarts times in --restart-window-s, then everything stops; 'never' "
                "stops everything at the first death (for an outer supervisor to restart)"})
    max_restarts: int = field(default=5, metadata={
        "help": "most restarts of one role within --restart-window-s"})
    restart_window_s: float = field(default=600.0, metadata={
        "help": "window of --max-restarts"})

    def __post_init__(self) -> None:
        require(0 < self.ready_timeout_s <= 86400,
                f"--ready-timeout-s must be in (0, 86400] seconds, got {self.ready_timeout_s}")
        require(0 <= self.stop_grace_s <= 3600,
                f"--stop-grace-s must be in 0..3600 seconds, got {self.stop_grace_s}")
        require(self.restart in RESTART_POLICIES,
                f"--restart must be one of {', '.join(RESTART_POLICIES)}, got {self.restart!r}")
        require(self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}")
        require(0 < self.restart_window_s <= 86400 * 7,
                f"--restart-window-s must be in (0, 604800] seconds, got {self.restart_window_s}")
