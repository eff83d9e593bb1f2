"""`cli_procs.CliProc`, the start-and-wait-for-ready helper of the multi-process tests: a process
that exits before it is ready fails the start with its exit status and its output's tail."""

from __future__ import annotations

import pytest

from cli_procs import CliProc


@pytest.mark.parametrize("pipe", [False, True])
def test_a_process_that_exits_before_ready_fails_with_its_output(pipe: bool) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)bad exited with [1-9][0-9]* before it was ready:.*invalid choice"):
        CliProc(["no-such-command"], name="bad", pipe=pipe, timeout_s=120.0)
