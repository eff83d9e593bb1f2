"""Supervisor with real child processes (stand-ins from standin.py): readiness, start failures,
shutdown of process groups, restarts, the parent-death signal and the shared-memory sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from yuebing.cluster import RoleFailed, RoleSpec, Supervisor, SupervisorConfig
from yuebing.cluster.readiness import AllOf, HttpOk, ReadyFile

STANDIN = str(Path(__file__).with_name("standin.py"))


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(cond, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


def role(tmp_path: Path, name: str, mode: str, *extra: str,
         restart: bool = True) -> tuple[RoleSpec, ReadyFile]:
    ready = tmp_path / f"{name}.ready"
    spec = RoleSpec(name, (sys.executable, STANDIN, mode, "--ready", str(ready), *extra),
                    restart=restart)
    return spec, ReadyFile(ready)


@pytest.fixture
def sup(tmp_path: Path):
    s = Supervisor(SupervisorConfig(log_dir=str(tmp_path / "logs"), stop_grace_s=5,
                                    ready_timeout_s=30))
    yield s
    s.stop()


def test_stages_start_ready_and_stop_in_reverse(tmp_path: Path, sup: Supervisor) -> None:
    first = sup.start_stage([role(tmp_path, "a", "serve", "--delay", "0.3")])
    second = sup.start_stage([role(tmp_path, "b", "serve"), role(tmp_path, "c", "parent")])
    assert first["a"]["pid"] == sup.pids()["a"]
    assert set(second) == {"b", "c"}
    grandchild = second["c"]["child"]
    assert alive(grandchild)
    assert (tmp_path / "logs" / "a.log").read_text().count("standin serve") == 1
    pids = sup.pids()
    sup.stop()
    for pid in [*pids.values(), grandchild]:
        assert not alive(pid)


def test_role_dying_at_start_names_it_and_quotes_its_log(tmp_path: Path,
                                                          sup: Supervisor) -> None:
    sup.start_stage([role(tmp_path, "store-master", "serve")])
    with pytest.raises(RoleFailed) as e:
        sup.start_stage([role(tmp_path, "prefill-0", "fail"), role(tmp_path, "ok", "serve")])
    msg = str(e.value)
    assert e.value.role == "prefill-0"
    assert "role prefill-0 exited while starting (exit code 3)" in msg
    assert "cannot bind 127.0.0.1:1 (permission denied)" in msg
    assert str(tmp_path / "logs" / "prefill-0.log") in msg
    pids = sup.pids()
    sup.stop()
    assert not any(alive(p) for p in pids.values())


def test_role_not_ready_in_time(tmp_path: Path) -> None:
    s = Supervisor(SupervisorConfig(log_dir=str(tmp_path), ready_timeout_s=0.5))
    try:
        with pytest.raises(RoleFailed, match="role slow was not ready within 0.5s"):
            s.start_stage([role(tmp_path, "slow", "never")])
    finally:
        s.stop()
    assert not alive(s.pids()["slow"])


def test_ready_deadlines_wait_while_a_startup_profile_measures(tmp_path: Path) -> None:
    """A first start on a slow CPU profiles for minutes: while the profile lock is held
    exclusively, the ready deadline does not run (then it does)."""
    import threading

    from yuebing.instance import profile_cache

    cache = tmp_path / "profiles"
    held, release = threading.Event(), threading.Event()

    def profiling() -> None:
        with profile_cache._cache_lock(cache):
            held.set()
            release.wait(10)

    s = Supervisor(SupervisorConfig(log_dir=str(tmp_path / "logs"), ready_timeout_s=0.5),
                   paused=lambda: profile_cache.measuring(cache))
    t = threading.Thread(target=profiling)
    t.start()
    try:
        assert held.wait(5)
        threading.Timer(3.0, release.set).start()  # the profile ends after 3 s: the role's
        # 1.2 s start, over twice its 0.5 s deadline, fits in the time paused
        info = s.start_stage([role(tmp_path, "prefill-0", "serve", "--delay", "1.2")])
        assert info["prefill-0"]["pid"]
        t.join()
        with pytest.raises(RoleFailed, match="not ready within 0.5s"):  # no profile: it runs
            s.start_stage([role(tmp_path, "slow", "never")])
    finally:
        release.set()
        s.stop()


def test_http_readiness(tmp_path: Path, sup: Supervisor) -> None:
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    spec = RoleSpec("conductor", (sys.executable, STANDIN, "http", "--port", str(port),
                                  "--delay", "0.3"))
    info = sup.start_stage([(spec, AllOf(HttpOk(f"http://127.0.0.1:{port}/health")))])
    assert info["conductor"]["health_url"] == f"http://127.0.0.1:{port}/health"


def test_conductor_ready_once_its_view_has_the_instances(tmp_path: Path,
                                                          sup: Supervisor) -> None:
    """The Conductor answers /health before it has heard from the instances: the plan's
    check waits until they are in its view (a 200 alone let the first request get 503)."""
    import socket

    from yuebing.cluster.readiness import HttpJson
    from yuebing.cluster.serve import _instances_in_view

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    spec = RoleSpec("conductor", (sys.executable, STANDIN, "http", "--port", str(port)))
    check = HttpJson(f"http://127.0.0.1:{port}/health",
                     lambda body: {"p0"} <= _instances_in_view(body))
    info = sup.start_stage([(spec, check)])
    assert info["conductor"]["health"] == {"ready": True, "instances": {"prefill": ["p0"]}}
    assert _instances_in_view({"instances": {"prefill": ["a"], "decode": ["b"]}}) == {"a", "b"}
    assert _instances_in_view({"instances": None}) == set() == _instances_in_view([])


def test_sigterm_ignored_then_killed(tmp_path: Path) -> None:
    s = Supervisor(SupervisorConfig(log_dir=str(tmp_path), stop_grace_s=0.3))
    s.start_stage([role(tmp_path, "stubborn", "stubborn")])
    pid = s.pids()["stubborn"]
    s.stop()
    assert not alive(pid)
    assert "killing it" not in (tmp_path / "stubborn.log").read_text()  # the log is the child's


def test_dead_role_is_restarted_with_a_new_process(tmp_path: Path, sup: Supervisor) -> None:
    sup.start_stage([role(tmp_path, "decode-0", "serve")])
    first = sup.pids()["decode-0"]
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: sup.check() == "" and sup.pids()["decode-0"] != first
               and sup.info("decode-0").get("pid") == sup.pids()["decode-0"])
    assert alive(sup.pids()["decode-0"])
    assert (tmp_path / "logs" / "decode-0.log").read_text().count("standin serve") == 2


def test_restart_never_stops_the_cluster(tmp_path: Path) -> None:
    s = Supervisor(SupervisorConfig(log_dir=str(tmp_path), restart="never"))
    try:
        s.start_stage([role(tmp_path, "conductor", "die-after", "--delay", "0.2")])
        assert s.watch() == 1
        assert s.failed == "role conductor died (restart is off)"
    finally:
        s.stop()


def test_crash_loop_gives_up_after_max_restarts(tmp_path: Path) -> None:
    s = Supervisor(SupervisorConfig(log_dir=str(tmp_path), max_restarts=1))
    try:
        s.start_stage([role(tmp_path, "prefill-0", "die-after", "--delay", "0.1")])
        assert s.watch() == 1
        assert s.failed.startswith("role prefill-0 died 2 times within 600s (--max-restarts 1)")
    finally:
        s.stop()


def test_dead_role_shm_segments_are_swept(tmp_path: Path, sup: Supervisor) -> None:
    info = sup.start_stage([role(tmp_path, "node", "shm", restart=False)])["node"]
    files = [Path("/dev/shm") / n for n in info["shm"]]
    assert files and all(f.exists() for f in files)
    os.kill(info["pid"], signal.SIGKILL)
    wait_until(lambda: sup.check() != "")
    assert not any(f.exists() for f in files)


SUPERVISOR_SCRIPT = """
import json, os, sys
from yuebing.cluster import Interrupted, RoleSpec, Supervisor, SupervisorConfig
from yuebing.cluster.readiness import ReadyFile
d, standin, second = sys.argv[1], sys.argv[2], sys.argv[3]
s = Supervisor(SupervisorConfig(log_dir=d, stop_grace_s=float(sys.argv[4])))
s.install_signal_handlers()
s.start_stage([(RoleSpec(n, (sys.executable, standin, m, "--ready", f"{d}/{n}.ready")),
                ReadyFile(f"{d}/{n}.ready")) for n, m in (("a", "serve"), ("b", "parent"))])
pids = dict(s.pids(), grandchild=s.info("b")["child"])
open(f"{d}/pids.tmp", "w").write(json.dumps(pids))
os.replace(f"{d}/pids.tmp", f"{d}/pids.json")  # whole when seen: the test polls for it
try:
    if second != "-":
        s.start_stage([(RoleSpec("c", (sys.executable, standin, second, "--ready",
                                       f"{d}/c.ready")), ReadyFile(f"{d}/c.ready"))])
    open(f"{d}/watching", "w").close()
    code = s.watch()
except Interrupted:
    code = 130
s.stop()
print("stopped", code, flush=True)
"""


def _run_supervisor(tmp_path: Path, second: str = "-", grace_s: float = 5.0
                    ) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """A supervisor process running roles a (serve) and b (parent), then c (``second``)."""
    import json

    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT, str(tmp_path), STANDIN,
                             second, str(grace_s)], stdout=subprocess.PIPE, text=True)
    wait_until(lambda: (tmp_path / "pids.json").exists() or proc.poll() is not None)
    assert proc.poll() is None
    return proc, json.loads((tmp_path / "pids.json").read_text())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_stops_every_process(tmp_path: Path, sig: int) -> None:
    proc, pids = _run_supervisor(tmp_path)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert out.strip().endswith("stopped 0")
    assert not any(alive(p) for p in pids.values())


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    proc, pids = _run_supervisor(tmp_path)
    proc.kill()
    proc.wait(10)
    wait_until(lambda: not alive(pids["a"]) and not alive(pids["b"]))
    os.kill(pids["grandchild"], signal.SIGKILL)  # a role's own children are the role's job


def test_signal_while_starting_stops_what_started(tmp_path: Path) -> None:
    proc, pids = _run_supervisor(tmp_path, second="never")
    wait_until(lambda: "standin never" in (tmp_path / "c.log").read_text()
               if (tmp_path / "c.log").exists() else False)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert out.strip().endswith("stopped 130")
    assert not any(alive(p) for p in pids.values())


def test_second_signal_kills_at_once(tmp_path: Path) -> None:
    """A role ignoring SIGTERM under a 600 s grace: the second Ctrl-C ends the wait."""
    import json

    proc, pids = _run_supervisor(tmp_path, second="stubborn", grace_s=600)
    wait_until(lambda: (tmp_path / "watching").exists())
    pids["c"] = json.loads((tmp_path / "c.ready").read_text())["pid"]
    proc.send_signal(signal.SIGINT)
    wait_until(lambda: "SIGTERM ignored" in (tmp_path / "c.log").read_text())
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert out.strip().endswith("stopped 0")
    assert not any(alive(p) for p in pids.values())


def test_program_that_cannot_start(tmp_path: Path, sup: Supervisor) -> None:
    missing = str(tmp_path / "no-such-program")
    with pytest.raises(RoleFailed, match=f"role ghost could not be started .*{missing}"):
        sup.start_stage([(RoleSpec("ghost", (missing,)), ReadyFile(tmp_path / "x"))])
