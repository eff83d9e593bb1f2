"""Core lending for vLLM instances without vLLM: `lend.StepThreads` on a real `CoreLedger`
file (a step borrows an idle peer's core, gives it back after its forward, waits for a
borrower's step, and an instance with no step goes idle), and the flags and settings that turn
it on, from ``yuebing serve --engine vllm`` down to the connector's extra config."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from yuebing.core.cpus import format_cpus
from yuebing.core.errors import ConfigError
from yuebing.instance.cores import CoreLedger
from yuebing.integrations.vllm.config import VllmConnectorConfig
from yuebing.integrations.vllm.lend import StepThreads
from yuebing.integrations.vllm.server import VllmServerConfig


def environ_outside() -> str | None:
    import os
    return os.environ.get("GOMP_CPU_AFFINITY")


def _until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def test_a_step_borrows_the_idle_peers_core_and_an_instance_without_steps_goes_idle(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    set_to: list[int] = []
    lend = StepThreads(CoreLedger(1, path, cores=2), set_to.append, idle_after_s=0.5)
    peer = CoreLedger(1, path, cores=2)  # the other instance (another slot of the file)
    try:
        assert lend.begin() == 2 and set_to == [2]  # the peer is idle: both cores
        lend.end()
        assert set_to == [2, 1]  # own threads again for what vLLM runs after the forward
        assert peer.acquire() == 1  # our claim outlives the step (idle_after_s: long, so a
        # starved test process is not idle yet): the peer keeps to its own
        peer.release(idle=True)
        _until(lambda: peer.acquire() == 2)  # no step for idle_after_s: we are idle
        # the peer steps on both cores: our next step waits for it, then runs on our own
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(lend.begin()))
        t.start()
        t.join(0.2)  # nothing more happens meanwhile: it waits for the peer's step
        assert t.is_alive() and not got
        peer.release(idle=False)  # its step ends, it keeps its claim
        t.join(5)
        assert got == [1] and set_to == [2, 1]  # one thread: already set
        lend.end()
        peer.release(idle=True)
        lend.end()  # a second end (vLLM's no-forward path) changes nothing
        assert set_to == [2, 1]
    finally:
        lend.close()
        peer.close()


def test_the_settings_that_turn_lending_on_and_their_refusals() -> None:
    assert VllmConnectorConfig.from_extra({"lend_threads": 1, "lend_cores": 2}).lend_threads == 1
    assert VllmConnectorConfig().lend_threads == 0  # off unless the server turns it on
    with pytest.raises(ConfigError, match="lend_threads 3 .* is more than lend_cores 2"):
        VllmConnectorConfig.from_extra({"lend_threads": 3, "lend_cores": 2})
    with pytest.raises(ConfigError, match="lend_threads and lend_cores must be >= 0"):
        VllmConnectorConfig.from_extra({"lend_threads": -1})
    from yuebing.core.cpus import usable_cpus
    usable = usable_cpus()
    own = (usable[-1],)
    cfg = VllmServerConfig(port=8001, master="tcp://127.0.0.1:1", threads=1, cpus=own,
                           lend_cpus=usable)
    env = cfg.environ()
    assert cfg.affinity == usable and env["OMP_NUM_THREADS"] == str(len(usable))
    # bound by libgomp in this order, own CPU first (vLLM's own binding sorts them)
    order = own + tuple(c for c in usable if c not in own)
    assert env["GOMP_CPU_AFFINITY"] == " ".join(map(str, order))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    extra = cfg.kv_transfer_config()["kv_connector_extra_config"]
    assert (extra["lend_threads"], extra["lend_cores"]) == (1, len(usable))
    pinned = VllmServerConfig(port=8001, master="tcp://127.0.0.1:1", threads=1, cpus=own)
    assert pinned.affinity == own and pinned.environ()["OMP_NUM_THREADS"] == "1"
    assert "GOMP_CPU_AFFINITY" not in pinned.environ() or pinned.environ()[
        "GOMP_CPU_AFFINITY"] == environ_outside()
    assert pinned.environ()["VLLM_CPU_OMP_THREADS_BIND"] == format_cpus(own)
    assert "lend_threads" not in pinned.kv_transfer_config()["kv_connector_extra_config"]
    with pytest.raises(ConfigError, match="lend_cpus: the cores are lent by the connector"):
        VllmServerConfig(port=8001, threads=1, cpus=own, lend_cpus=usable)
    with pytest.raises(ConfigError, match=r"lend_cpus 0 must hold the server's own CPUs 1"):
        VllmServerConfig(port=8001, master="tcp://127.0.0.1:1", threads=1, cpus=(1,),
                         lend_cpus=(0,))


def test_vllm_instances_lend_their_cores_only_when_asked(tmp_path, monkeypatch) -> None:
    import argparse

    import yuebing.cluster.serve as serve
    import yuebing.integrations.vllm.instance as instance
    from yuebing.cluster.serve import ServeConfig, ServePlan
    from yuebing.core.config import add_config_args, config_from_args
    from yuebing.instance.config import InstanceConfig
    from yuebing.integrations.vllm.instance import VllmInstanceConfig
    from yuebing.integrations.vllm.profile import started_hardware

    monkeypatch.setattr(instance, "usable_cpus", lambda: (0, 1))
    assert VllmInstanceConfig(cpus="1", lend_cores=True).lend_cpus() == (0, 1)
    assert VllmInstanceConfig(cpus="1").lend_cpus() == ()  # opt-in
    assert VllmInstanceConfig().lend_cpus() == ()  # every CPU already its own
    assert started_hardware(1, 2)["lend_cores"] == "2"  # another profile than pinned
    assert "lend_cores" not in started_hardware(1)

    monkeypatch.setattr(serve, "usable_cpus", lambda: (0, 1))

    def adapter(cfg: ServeConfig) -> VllmInstanceConfig:
        name, role = cfg.instance_roles[-1]
        a = list(ServePlan(cfg, tmp_path).instance(name, role)[0].argv)
        p = argparse.ArgumentParser()
        add_config_args(p, VllmInstanceConfig)
        p.add_argument("--log-dir")
        p.add_argument("--ready-file")
        return config_from_args(VllmInstanceConfig, p.parse_args(a[a.index("instance") + 1:]))

    # `serve --engine vllm` keeps each vLLM on its own CPUs, whatever its --lend-cores (which
    # lends yuebing's own instances' cores, on by default)
    for lend in (True, False):
        got = adapter(ServeConfig(prefill=1, decode=1, engine="vllm",
                                  instance=InstanceConfig(lend_cores=lend)))
        assert got.cpus == "1" and not got.lend_cores
    # --vllm-lend-cores turns the adapters' lending on (each still named its own CPU first)
    for lend in (True, False):
        cfg = ServeConfig(prefill=1, decode=1, engine="vllm", vllm_lend_cores=True,
                          instance=InstanceConfig(lend_cores=lend))
        got = adapter(cfg)
        assert got.cpus == "1" and got.lend_cores and got.lend_cpus() == (0, 1)
        argv = ServePlan(cfg, tmp_path).instance(*cfg.instance_roles[-1])[0].argv
        assert "--no-lend-cores" not in argv and argv.count("--lend-cores") == 1
    with pytest.raises(ConfigError, match="--vllm-lend-cores is for --engine vllm"):
        ServeConfig(prefill=1, decode=1, vllm_lend_cores=True)
