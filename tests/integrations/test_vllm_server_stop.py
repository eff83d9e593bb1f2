"""`VllmServer.stop` leaves nothing of the server's process group behind, also when the API
server itself was killed first (its engine-core and worker processes outlive it, and get SIGTERM
and time to clean up: vLLM's resource tracker unlinks its semaphores only then) or its adapter
is stopped while it loads; the server runs at the priority and on the CPUs given, and CPUs it
cannot run on are refused naming them. Without a real vLLM: a shell stands in, with a child in
its group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from yuebing.integrations.vllm.server import VllmServer, VllmServerConfig
from yuebing.ops.priority import EnginePriority
from yuebing.ops.procs import yuebing_argv


class _ShellConfig(VllmServerConfig):
    def argv(self, env: object) -> list[str]:  # type: ignore[override]
        # the "engine core": a child in the same process group, writing its pid
        return ["bash", "-c", f"sleep 300 & echo $! > {self.extra[0][1]}; wait"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def _child(path: Path) -> int:
    end = time.monotonic() + 60  # a loaded host starts the adapter slowly
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < end
        time.sleep(0.02)
    return int(path.read_text())


def test_stop_kills_the_group_even_after_the_server_died(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    server = VllmServer(_ShellConfig(port=1, extra=(("pidfile", str(pidfile)),)),
                        tmp_path / "vllm.log")
    child = _child(pidfile)
    os.kill(server.proc.pid, signal.SIGKILL)  # the API server dies, its child lives on
    server.proc.wait(10)
    assert _alive(child)
    server.stop(timeout_s=1)
    end = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < end, "the server's child outlived stop()"
        time.sleep(0.02)


class _CleanerConfig(VllmServerConfig):
    def argv(self, env: object) -> list[str]:
        # the "engine core": cleans up for a while on SIGTERM, then writes that it did
        return ["bash", "-c", f"{sys.executable} {self.extra[0][1]} & wait"]


CLEANER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    here = Path(sys.argv[0]).parent
    def cleanup(*_):
        time.sleep(0.5)
        (here / "cleaned").write_text("yes")
        sys.exit(0)
    signal.signal(signal.SIGTERM, cleanup)
    (here / "child.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)
""")


def test_after_the_server_died_its_group_gets_sigterm_and_time_to_clean_up(
        tmp_path: Path) -> None:
    script = tmp_path / "cleaner.py"
    script.write_text(CLEANER)
    server = VllmServer(_CleanerConfig(port=1, extra=(("script", str(script)),)),
                        tmp_path / "vllm.log")
    child = _child(tmp_path / "child.pid")
    os.kill(server.proc.pid, signal.SIGKILL)  # the API server dies, its child lives on
    server.proc.wait(10)
    server.stop(timeout_s=60)
    assert not _alive(child)
    assert (tmp_path / "cleaned").read_text() == "yes"  # not SIGKILLed in its clean-up


def test_stop_ends_a_running_server_and_its_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    server = VllmServer(_ShellConfig(port=1, extra=(("pidfile", str(pidfile)),)),
                        tmp_path / "vllm.log")
    child = _child(pidfile)
    server.stop(timeout_s=5)
    assert server.proc.returncode is not None
    end = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < end, "the server's child outlived stop()"
        time.sleep(0.02)


def test_the_server_runs_at_the_priority_given_from_its_exec_on(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    server = VllmServer(_ShellConfig(port=1, extra=(("pidfile", str(pidfile)),),
                                     priority=EnginePriority(nice=4, idle=True)),
                        tmp_path / "vllm.log")
    try:
        child = _child(pidfile)  # started by the server: inherits what was set before exec
        for pid in (server.proc.pid, child):
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(
                19, os.getpriority(os.PRIO_PROCESS, 0) + 4)
            if Path("/proc/self/autogroup").exists():  # the server's session is its group
                assert Path(f"/proc/{pid}/autogroup").read_text().split()[-1] == "4"
    finally:
        server.stop(timeout_s=5)


def test_the_server_runs_on_the_cpus_given_its_threads_bound_to_them(tmp_path: Path) -> None:
    from yuebing.core.cpus import usable_cpus

    cpus = usable_cpus()[-1:]
    cfg = _ShellConfig(port=1, extra=(("pidfile", str(tmp_path / "child.pid")),), threads=1,
                       cpus=cpus)
    assert cfg.environ()["VLLM_CPU_OMP_THREADS_BIND"] == str(cpus[0])
    assert cfg.environ()["OMP_NUM_THREADS"] == "1"
    server = VllmServer(cfg, tmp_path / "vllm.log")
    try:
        child = _child(tmp_path / "child.pid")
        for pid in (server.proc.pid, child):
            assert os.sched_getaffinity(pid) == set(cpus)
    finally:
        server.stop(timeout_s=5)
    unpinned = VllmServerConfig(port=1, threads=1)
    assert unpinned.environ()["VLLM_CPU_OMP_THREADS_BIND"] == str(usable_cpus()[0])


def test_cpus_it_may_not_run_on_are_refused_naming_them(tmp_path: Path, monkeypatch) -> None:
    import yuebing.integrations.vllm.server as server_mod
    from yuebing.core.cpus import format_cpus, usable_cpus
    from yuebing.core.errors import ConfigError

    usable = usable_cpus()
    cfg = _ShellConfig(port=1, extra=(("pidfile", str(tmp_path / "child.pid")),), threads=1,
                       cpus=(max(usable) + 1,))
    with pytest.raises(ConfigError, match=f"^vLLM server CPUs {max(usable) + 1}: CPU "
                       f"{max(usable) + 1} is not one this process may run on"):
        VllmServer(cfg, tmp_path / "vllm.log")

    def failing(priority: EnginePriority, cpus: tuple[int, ...]) -> None:
        raise OSError(22, "Invalid argument")  # as sched_setaffinity when a CPU went offline

    monkeypatch.setattr(server_mod, "_child_setup", failing)  # what the child calls
    cfg = _ShellConfig(port=1, extra=(("pidfile", str(tmp_path / "child.pid")),), threads=1,
                       cpus=usable[-1:])
    with pytest.raises(ConfigError, match=f"^vLLM server: setting its CPUs {usable[-1]} "
                       f"\\(usable: {format_cpus(usable)}\\) and priority \\(nice 0\\) "
                       "before its exec failed"):
        VllmServer(cfg, tmp_path / "vllm.log")


def test_an_adapter_stopped_while_its_vllm_loads_stops_it(tmp_path: Path) -> None:
    """A supervisor's ready timeout SIGTERMs the adapter while vLLM still loads: vLLM (in a
    session of its own, so not in the adapter's process group) must go with it."""
    peers, pidfile = tmp_path / "peers", tmp_path / "server.pid"
    python = peers / "vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # never ready, and deaf to SIGTERM (as a vLLM still loading its model can be)
    python.write_text(f"#!/bin/bash\ntrap '' TERM\necho $$ > {pidfile}\nexec sleep 300\n")
    python.chmod(0o755)
    (peers / "smollm2-135m-instruct-hf").mkdir()
    (peers / "smollm2-135m-instruct-hf" / "config.json").write_text("{}")
    env = {**os.environ, "YUEBING_PEERS_DIR": str(peers), "XDG_CACHE_HOME": str(tmp_path)}
    adapter = subprocess.Popen(yuebing_argv(["vllm", "instance", "--vllm-port", "1",
                                             "--log-dir", str(tmp_path)]),
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = 0
    try:
        server = _child(pidfile)
        adapter.terminate()
        code = adapter.wait(30)
        end = time.monotonic() + 60
        while _alive(server):
            assert time.monotonic() < end, "the loading vLLM outlived its adapter"
            time.sleep(0.02)
        assert code == 128 + signal.SIGTERM
    finally:
        adapter.kill()
        adapter.wait(10)
        if server:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server, signal.SIGKILL)  # its session's group, if it outlived it
