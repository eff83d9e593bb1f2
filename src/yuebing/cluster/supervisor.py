"""`Supervisor`: start role processes in stages, wait for their readiness, watch, stop.

Owned by `yuebing.cluster.serve.run_serve` on the main thread for its whole life (children die
with the thread that spawned them). `start_stage` spawns a stage's roles at once (a log file
each under ``log_dir``) and polls their readiness; a role that exits or misses
``ready_timeout_s`` raises `RoleFailed` with its log tail. `watch` runs until `request_stop`: a
dead role's shared-memory segments are swept and it is restarted with backoff, or past the
restart limit (or ``restart="never"``) `watch` returns 1. `stop` stops stages in reverse order:
SIGTERM to each process group, SIGKILL after ``stop_grace_s`` or at once on a second request,
and no process of a stopped group runs once `stop` returns.
"""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from yuebing.cluster.config import SupervisorConfig
from yuebing.cluster.process import RoleProcess, RoleSpec, describe_exit
from yuebing.cluster.readiness import Info, Readiness
from yuebing.core.errors import YuebingError

log = logging.getLogger(__name__)

POLL_S = 0.05
MAX_BACKOFF_S = 30.0
PAUSE_MAX_S = 3600.0
"""The most the ready deadlines wait for start-up profiles in all (a hung one fails the start)."""


class RoleFailed(YuebingError):
    """A role died or never became ready; the message names it and quotes its log."""

    def __init__(self, role: str, reason: str, log_path: Path, tail: str) -> None:
        body = "\n".join("    " + line for line in tail.splitlines()) or "    (empty log)"
        super().__init__(f"role {role} {reason}; last lines of {log_path}:\n{body}")
        self.role = role
        self.reason = reason
        self.log_path = log_path


@dataclass
class _Role:
    spec: RoleSpec
    ready: Readiness
    stage: int
    proc: RoleProcess | None = None
    info: Info = field(default_factory=dict)
    ready_at: float | None = None
    paused_mark: float = 0.0
    """The supervisor's paused seconds when this process was spawned."""
    restart_at: float | None = None
    deaths: deque[float] = field(default_factory=deque)


class Supervisor:
    """Runs the roles of one host; see the module docstring for the life cycle."""

    def __init__(self, cfg: SupervisorConfig, paused: Callable[[], bool] | None = None) -> None:
        self.cfg = cfg
        self.paused = paused
        """While it says True (a start-up profile measures on this host), starting roles'
        ready deadlines wait: a first start on a slow CPU profiles for minutes."""
        self._paused_s = 0.0
        self._tick_at = time.monotonic()
        self._was_paused = False
        if cfg.log_dir:
            self.log_dir = Path(cfg.log_dir)
            self.log_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.log_dir = Path(tempfile.mkdtemp(prefix="yuebing-serve-"))
        self._roles: dict[str, _Role] = {}
        self._stages = 0
        self._stop = threading.Event()
        self._force = threading.Event()
        self.failed: str = ""
        """Why `watch` gave up ('' while it has not)."""

    # ------------------------------------------------------------------ signals
    def request_stop(self) -> None:
        """Ask `watch` (or a start in progress) to end; a second call kills at once.
        Safe to call from a signal handler."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGINT, SIGTERM and SIGHUP (the terminal closed) call `request_stop` (main thread
        only)."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: self.request_stop())

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------------ start
    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start_stage(self, roles: Sequence[tuple[RoleSpec, Readiness]]) -> dict[str, Info]:
        """Spawn ``roles`` together and wait until every one is ready; returns their info by
        name. Raises `RoleFailed` (a role exited or timed out) or `Interrupted`."""
        stage = self._stages
        self._stages += 1
        new = []
        for spec, ready in roles:
            if spec.name in self._roles:
                raise ValueError(f"role {spec.name!r} started twice")
            role = self._roles[spec.name] = _Role(spec, ready, stage)
            self._spawn(role)
            new.append(role)
        while any(r.ready_at is None for r in new):
            if self._stop.is_set():
                raise Interrupted("stopped while starting")
            self._tick()
            for r in new:
                if r.ready_at is None:
                    self._check_starting(r)
            time.sleep(POLL_S)
        return {r.spec.name: r.info for r in new}

    def _tick(self) -> None:
        """Count the time since the last tick (at most a second: ticks stop while every role
        serves) as paused while `paused` says a start-up profile measures, up to
        `PAUSE_MAX_S` in all (a hung profile still fails the start)."""
        now = time.monotonic()
        paused = self.paused is not None and self.paused() and self._paused_s < PAUSE_MAX_S
        if paused:
            self._paused_s += min(1.0, now - self._tick_at)
            if not self._was_paused:
                log.info("a start-up profile measures on this host: the roles' ready "
                         "deadlines wait for it")
        self._was_paused = paused
        self._tick_at = now

    def _deadline(self, role: _Role) -> float:
        """When ``role`` must be ready: ``ready_timeout_s`` after its start, plus the time
        paused since."""
        assert role.proc is not None
        return role.proc.started_at + self.cfg.ready_timeout_s + \
            self._paused_s - role.paused_mark

    def _spawn(self, role: _Role) -> None:
        role.ready.reset()
        role.info = {}
        role.ready_at = None
        role.paused_mark = self._paused_s
        try:
            role.proc = RoleProcess(role.spec, self.log_path(role.spec.name))
        except OSError as e:  # no such program, no permission, log dir unwritable
            raise RoleFailed(role.spec.name, f"could not be started ({e})",
                             self.log_path(role.spec.name), "") from e

    def _check_starting(self, role: _Role) -> None:
        """Poll one starting role: ready -> record; exited or late (`_deadline`) ->
        `RoleFailed`."""
        assert role.proc is not None
        code = role.proc.poll()
        if code is not None:
            raise self._failure(role, f"exited while starting ({describe_exit(code)})")
        got = role.ready.poll({})
        if got is not None:
            role.info = {**got, "pid": role.proc.pid}
            role.ready_at = time.monotonic()
            log.info("%s ready (pid %d, %.1fs)", role.spec.name, role.proc.pid,
                     role.ready_at - role.proc.started_at)
        elif time.monotonic() > self._deadline(role):
            raise self._failure(role, f"was not ready within {self.cfg.ready_timeout_s:g}s")

    def _failure(self, role: _Role, reason: str) -> RoleFailed:
        assert role.proc is not None
        return RoleFailed(role.spec.name, reason, role.proc.log_path, role.proc.log_tail())

    def info(self, name: str) -> Info:
        """What role ``name`` reported when it became ready (its ready file, pid)."""
        return self._roles[name].info

    def pids(self) -> dict[str, int]:
        """Pid of every role's current process (also exited ones)."""
        return {n: r.proc.pid for n, r in self._roles.items() if r.proc is not None}

    # ------------------------------------------------------------------ watch
    def watch(self) -> int:
        """Run `check` until `request_stop`; 0 then, 1 if a role failed for good (``failed``
        says which and why). Does not stop the roles: call `stop`. Run it on the thread that
        started the roles (a restarted child dies with the thread that spawned it)."""
        while not self._stop.wait(POLL_S * 4):
            reason = self.check()
            if reason:
                log.error("%s; stopping the cluster", reason)
                return 1
        return 0

    def check(self) -> str:
        """One pass over the roles: report deaths, schedule and perform restarts, follow
        restarted roles' readiness. Returns why the cluster must stop ('' = fine)."""
        if any(r.ready_at is None and r.restart_at is None for r in self._roles.values()):
            self._tick()
        for role in list(self._roles.values()):
            reason = self._check_running(role)
            if reason:
                self.failed = reason
                return reason
        return ""

    def _check_running(self, role: _Role) -> str:
        """One watch step for ``role``; returns why the cluster must stop ('' = fine)."""
        now = time.monotonic()
        if role.restart_at is not None:
            return self._restart_if_due(role, now)
        proc = role.proc
        assert proc is not None
        code = proc.poll()
        if code is None:
            return self._follow_restarted(role, proc, now) if role.ready_at is None else ""
        log.error("role %s (pid %d) died: %s; last lines of %s:\n%s", role.spec.name, proc.pid,
                  describe_exit(code), proc.log_path, proc.log_tail())
        proc.kill_group()  # anything it started, gone before the sweep looks at its files
        sweep_shm()
        return self._after_death(role, now)

    def _restart_if_due(self, role: _Role, now: float) -> str:
        assert role.restart_at is not None
        if now < role.restart_at:
            return ""
        role.restart_at = None
        log.warning("restarting %s", role.spec.name)
        try:
            self._spawn(role)
        except RoleFailed as e:
            log.error("%s", e)
            return self._after_death(role, now)
        return ""

    def _follow_restarted(self, role: _Role, proc: RoleProcess, now: float) -> str:
        """Poll the readiness of a restarted role; one not ready in time counts as a death."""
        try:
            self._check_starting(role)
        except RoleFailed as e:
            log.error("%s", e)
            proc.kill_group()
            return self._after_death(role, now)
        if role.ready_at is not None:
            log.warning("%s is back (pid %d)", role.spec.name, proc.pid)
        return ""

    def _after_death(self, role: _Role, now: float) -> str:
        """Schedule a restart of a dead role or say why the cluster must stop."""
        name = role.spec.name
        if self.cfg.restart == "never" or not role.spec.restart:
            return f"role {name} died (restart is off)"
        role.deaths.append(now)
        while role.deaths and role.deaths[0] < now - self.cfg.restart_window_s:
            role.deaths.popleft()
        if len(role.deaths) > self.cfg.max_restarts:
            return (f"role {name} died {len(role.deaths)} times within "
                    f"{self.cfg.restart_window_s:g}s (--max-restarts {self.cfg.max_restarts})")
        backoff = min(MAX_BACKOFF_S, 2.0 ** (len(role.deaths) - 1))
        role.restart_at = now + backoff
        log.warning("%s will restart in %.0fs (restart %d of at most %d in %gs)", name, backoff,
                    len(role.deaths), self.cfg.max_restarts, self.cfg.restart_window_s)
        return ""

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop every role, later stages first; idempotent."""
        for stage in reversed(range(self._stages)):
            procs = [r.proc for r in self._roles.values()
                     if r.stage == stage and r.proc is not None]
            self._stop_procs(procs)
        sweep_shm()

    def _stop_procs(self, procs: Sequence[RoleProcess]) -> None:
        grace = 0.0 if self._force.is_set() else self.cfg.stop_grace_s
        for p in procs:
            p.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.alive() for p in procs) and time.monotonic() < deadline:
            if self._force.is_set():
                break
            time.sleep(POLL_S)
        for p in procs:
            if p.alive():
                log.warning("%s (pid %d) still running; killing it", p.name, p.pid)
            p.kill_group()  # its leftovers too: none runs once `stop` returns
        if procs:
            log.info("stopped %s in %.1fs", ", ".join(p.name for p in procs),
                     time.monotonic() - deadline + grace)


class Interrupted(YuebingError):
    """`request_stop` was called while a stage was starting."""


def sweep_shm() -> int:
    """Unlink the shared-memory segment files of dead owners (the transfer engine's sweep:
    `yuebing.transfer.liveness.sweep_dead_segments`); returns how many were removed. Called
    when a child dies and after `stop` (a SIGKILLed child cannot remove its own)."""
    try:
        from yuebing.transfer.liveness import sweep_dead_segments

        removed = len(sweep_dead_segments())
    except Exception as e:  # noqa: BLE001 - never let cleanup break a shutdown
        log.warning("shared-memory sweep failed: %s", e)
        return 0
    if removed:
        log.info("removed %d shared-memory segments of dead processes", removed)
    return removed
