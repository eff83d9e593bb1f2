"""Real ``yuebing`` CLI processes for multi-process tests, on 127.0.0.1.

`CliProc` starts ``python -m yuebing.cli.main <args> --ready-file F`` as a
`yuebing.ops.procs.ReadyProcess`: it waits until the process has written the JSON it writes to
``F`` once it serves (``info``), and stops it (SIGTERM, then SIGKILL after ``stop_s``) or kills
it through the handle that started it — never by name. A process that exits or is not ready in
time is killed and its output's tail is in the error. The store's, the instances' and the
Conductor's helpers (``tests/store/store_procs.py``, ``tests/instance/instance_procs.py``,
``tests/conductor/procs.py``) build on it; ``tests/`` is on ``sys.path`` (pytest inserts its
conftest's directory), so any test imports it as ``cli_procs``.
"""

from __future__ import annotations

from pathlib import Path

from yuebing.ops.procs import ReadyProcess, yuebing_argv


class CliProc(ReadyProcess):
    """One ``yuebing <args>`` CLI process that writes a ready file (output, `log`, `stop`,
    `kill`: `ReadyProcess`). ``prefix`` is a command that execs the rest in place (so
    ``proc.pid`` is still the yuebing process), e.g. ``ip netns exec NS`` to start it in a
    network namespace."""

    def __init__(self, args: list[str], *, name: str = "proc", workdir: Path | None = None,
                 timeout_s: float = 60.0, stop_s: float = 15.0, pipe: bool = False,
                 log_tail: int = 4000, prefix: tuple[str, ...] = ()) -> None:
        super().__init__(yuebing_argv(args, prefix), name=name, workdir=workdir,
                         timeout_s=timeout_s, stop_s=stop_s, pipe=pipe, log_tail=log_tail)
