"""`ServeConfig` validation, the flags forwarded to the roles, and the plan's store stages with
the real ``yuebing store master|node`` processes under the supervisor."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
from pathlib import Path

import pytest

from yuebing.cluster import Supervisor, SupervisorConfig
from yuebing.cluster.serve import MANAGED, ServeConfig, ServePlan, banner, local_url_host
from yuebing.conductor.cli import conductor_args
from yuebing.conductor.config import ConductorConfig
from yuebing.conductor.policy import PolicyConfig
from yuebing.core.config import add_config_args, config_args, config_from_args
from yuebing.core.errors import ConfigError
from yuebing.instance.config import InstanceConfig


def test_serve_config_validation() -> None:
    assert [n for n, _ in ServeConfig(prefill=2).instance_roles] == ["prefill-0", "prefill-1",
                                                                      "decode-0"]
    assert ServeConfig(coupled=2).instance_roles == [("coupled-0", "coupled"),
                                                     ("coupled-1", "coupled")]
    with pytest.raises(ConfigError, match="a disaggregated cluster needs both"):
        ServeConfig(prefill=1, decode=0)
    ServeConfig(prefill=1, decode=0, etcd="http://10.0.0.1:2379")  # decodes on other hosts
    ServeConfig(prefill=0, decode=0, etcd="http://10.0.0.1:2379")  # store + conductor only
    with pytest.raises(ConfigError, match="no instances to serve"):
        ServeConfig(prefill=0, decode=0)
    with pytest.raises(ConfigError, match="--store-port must be in 0..65534"):
        ServeConfig(store_port=65535)
    plan = ServePlan(ServeConfig(store_port=50999), Path("."))
    assert (plan.master_addr, plan.events_addr) == ("tcp://127.0.0.1:50999",
                                                    "tcp://127.0.0.1:51000")
    with pytest.raises(ConfigError, match="--etcd must be an URL"):
        ServeConfig(etcd="10.0.0.1:2379")
    with pytest.raises(ConfigError, match="--prefill, --decode and --coupled must be >= 0"):
        ServeConfig(coupled=-1)
    with pytest.raises(ConfigError, match="--restart must be one of on-failure, never"):
        SupervisorConfig(restart="always")
    assert local_url_host("0.0.0.0") == "127.0.0.1" and local_url_host("::") == "[::1]"
    from yuebing.conductor.config import ConductorConfig
    from yuebing.conductor.policy import PolicyConfig

    with pytest.raises(ConfigError, match=r"--store-block-tokens must be the same for the "
                       r"Conductor \(512\) and the instances \(256\)"):
        ServeConfig(conductor=ConductorConfig(store_block_tokens=512,
                                              policy=PolicyConfig(block_tokens=512)))


@pytest.mark.parametrize("args, error", [
    (["--coupled", "2", "--prefill", "1"], "--coupled K replaces --prefill/--decode"),
    (["--admission", "bogus"], "admission 'bogus' unknown"),
    (["--prefill-queue", "lifo"], "prefill_queue 'lifo' unknown; use one of edf, fifo, sjf_aging"),
    (["--prefill-queue-aging", "-1"], "prefill_queue_aging must be a positive number"),
    (["--threads", "0"], "threads"),
    (["--tbt-tail-quantile", "1.5"], r"--tbt-tail-quantile must be in \(0, 1\], got 1.5"),
    (["--store-block-tokens", "100"], "store_block_tokens must be a positive multiple of 16"),
])
def test_bad_role_flags_fail_while_parsing(args: list[str], error: str) -> None:
    from yuebing.cli.main import build_parser
    from yuebing.cluster.cli import serve_config_from_args

    ns = build_parser().parse_args(["serve", *args])
    with pytest.raises(ConfigError, match=error):
        serve_config_from_args(ns)


def test_serve_refuses_bad_flags_before_starting_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "yuebing.cli.main", "serve", "--log-dir",
                          str(tmp_path / "logs"), "--admission", "bogus"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("yuebing: error: admission 'bogus' unknown"), out.stderr
    assert not (tmp_path / "logs").exists()  # no role was started


@dataclasses.dataclass(frozen=True)
class Inner:
    model: str = "smollm2"
    threads: int = 1
    hidden: int = 0


@dataclasses.dataclass(frozen=True)
class RoleCfg:
    warm: bool = True
    sizes: tuple[int, ...] = ()
    inner: Inner = dataclasses.field(default_factory=Inner,
                                     metadata={"flags": ("model", "threads")})
    instance_id: str = dataclasses.field(default="", metadata={"help": "set per child"})
    token: str = dataclasses.field(default="", metadata={"secret": True})


def test_config_args_rebuild_the_config() -> None:
    role = argparse.ArgumentParser()
    add_config_args(role, RoleCfg)
    assert "--hidden" not in role.format_help() and "--model" in role.format_help()
    cfg = RoleCfg(warm=False, sizes=(1, 2), inner=Inner(model="dummy"), instance_id="x",
                  token="s3cret")
    got = config_args(cfg, skip=("instance_id",))
    assert got == ("--no-warm", "--sizes", "1,2", "--model", "dummy")
    assert config_from_args(RoleCfg, role.parse_args(list(got))) == RoleCfg(
        warm=False, sizes=(1, 2), inner=Inner(model="dummy"))
    assert config_args(RoleCfg()) == ()


def test_plan_command_lines(tmp_path: Path) -> None:
    cfg = ServeConfig(prefill=1, decode=1, port=8123, instance=InstanceConfig(
        engine=dataclasses.replace(InstanceConfig().engine, model="dummy")),
        conductor=ConductorConfig(policy=PolicyConfig(block_tokens=256, admission="slo")))
    plan = ServePlan(cfg, tmp_path)
    stages = plan.stages()
    assert [[s.name for s, _ in st] for st in stages] == [
        ["store-master"], ["store-node"], ["prefill-0", "decode-0"], ["conductor"]]
    prefill = stages[2][0][0].argv
    assert prefill[3:7] == ("serve", "prefill", "--instance-id", "prefill-0")
    assert ("--store-master", plan.master_addr) == prefill[prefill.index("--store-master"):][:2]
    assert prefill[-2:] == ("--model", "dummy")
    assert "--role" not in prefill and "--cluster-token" not in prefill
    conductor = stages[3][0][0].argv
    inst = conductor[conductor.index("--instances") + 1].split(",")
    assert inst == [f"tcp://127.0.0.1:{plan.control[n]}" for n in ("prefill-0", "decode-0")]
    assert conductor[-2:] == ("--admission", "slo") and "--store-events" in conductor
    assert plan.base_url == "http://127.0.0.1:8123"
    etcd = ServePlan(ServeConfig(coupled=1, etcd="http://10.0.0.1:2379", store=False), tmp_path)
    roles = etcd.stages()
    assert [[s.name for s, _ in st] for st in roles] == [["coupled-0"], ["conductor"]]
    assert "--store-master" not in roles[0][0][0].argv
    argv = roles[0][0][0].argv
    assert argv[argv.index("--etcd"):][:4] == ("--etcd", "http://10.0.0.1:2379", "--cluster",
                                               "default")
    assert "--instances" not in roles[1][0][0].argv
    assert roles[1][0][0].argv[-4:] == ("--etcd", "http://10.0.0.1:2379", "--cluster", "default")


def test_store_stages_start_and_stop(tmp_path: Path) -> None:
    cfg = ServeConfig(store_dram=16 << 20)
    sup = Supervisor(SupervisorConfig(log_dir=str(tmp_path), ready_timeout_s=60))
    plan = ServePlan(cfg, sup.log_dir)
    stages = plan.stages()
    try:
        master = sup.start_stage(stages[0])["store-master"]
        assert master["address"] == plan.master_addr
        assert master["health_url"] == f"http://127.0.0.1:{plan.admin_port}/health"
        node = sup.start_stage(stages[1])["store-node"]
        assert node["dram"]
        shm = [e for e in os.listdir("/dev/shm") if e.startswith(f"yuebing-tx-{node['pid']}-")]
        assert shm
    finally:
        sup.stop()
    assert not any(os.path.exists(f"/proc/{p}") for p in sup.pids().values())
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"yuebing-tx-{node['pid']}-")]
    text = banner(plan, sup, "smollm2-135m-instruct")
    assert text.startswith("yuebing serve: ready (1 prefill + 1 decode, store 16MiB); logs in")
    assert (f"curl {plan.base_url}/v1/chat/completions -H 'content-type: application/json' -d "
            '\'{"model": "smollm2-135m-instruct", "stream": true, "messages": [{"role": "user", '
            '"content": "Hi"}]}\'') in text
    from yuebing.conductor.config import ConductorConfig

    dummy = ServePlan(ServeConfig(coupled=1, conductor=ConductorConfig(model="dummy")), tmp_path)
    assert (f"curl {dummy.base_url}/v1/completions -H 'content-type: application/json' -d "
            '\'{"model": "dummy", "prompt": [1, 2, 3], "max_tokens": 8}\'') in banner(
                dummy, sup, "dummy")


def test_serve_cli_offers_and_passes_role_flags() -> None:
    """`yuebing serve` offers the Conductor's and the instances' flags (less those the plan
    sets per child), builds their configs, and the plan starts each child with its config's
    flags; `yuebing serve <role>` still reaches the role's own command."""
    import yuebing.cli.main as main
    from yuebing.cluster.cli import serve_config_from_args

    parser = main.build_parser()
    ns = parser.parse_args(["serve", "--model", "dummy", "--admission", "slo", "--ttft-slo",
                            "5", "--threads", "2", "--no-warmup", "--port", "9000",
                            "--prefill", "1", "--decode", "1"])
    cfg = serve_config_from_args(ns)
    assert cfg.port == 9000 and cfg.conductor.port == ConductorConfig().port
    assert cfg.conductor.model == cfg.instance.engine.model == "dummy"
    assert cfg.conductor.policy.ttft_slo_s == 5.0 and cfg.instance.engine.threads == 2
    assert not cfg.instance.warmup and cfg.instance.role == "prefill"
    assert conductor_args(cfg.conductor, skip=MANAGED["conductor"]) == (
        "--model", "dummy", "--admission", "slo", "--ttft-slo-s", "5.0")
    assert config_args(cfg.instance, skip=MANAGED["instance"]) == (
        "--model", "dummy", "--threads", "2", "--no-warmup")
    for flags in (["serve", "--instances", "tcp://x:1"], ["serve", "--instance-id", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(flags)  # set by the plan, not offered
    vllm = serve_config_from_args(parser.parse_args(
        ["serve", "--engine", "vllm", "--vllm-lend-cores", "--prefill", "1", "--decode", "1"]))
    assert vllm.vllm_lend_cores and not cfg.vllm_lend_cores


@pytest.mark.parametrize(("flags", "cores", "roles", "threads"), [
    ([], 2, ["coupled-0"], 2),
    ([], 3, ["coupled-0"], 3),
    (["--threads", "1"], 2, ["coupled-0"], 1),  # the user's threads stay
    ([], 4, None, 0),  # from 4 cores: disaggregated, as before
    (["--prefill", "1", "--decode", "1"], 2, None, 0),
    (["--coupled", "2"], 2, None, 0),
    (["--prefill", "2", "--decode", "1", "--cpp-group", "2"], 2, None, 0),
    (["--etcd", "http://127.0.0.1:2379"], 2, None, 0),  # instances on other hosts
    (["--engine", "vllm"], 2, None, 0),
    (["--device", "cuda"], 2, None, 0),
    (["--coupled", "0"], 2, None, 0),  # an explicit 0: 1P1D
])
def test_the_default_topology_is_one_coupled_instance_on_a_small_cpu_host(
        flags: list[str], cores: int, roles: list[str] | None, threads: int) -> None:
    import yuebing.cli.main as main
    from yuebing.cluster.cli import default_topology, serve_config_from_args

    ns = main.build_parser().parse_args(["serve", *flags])
    before = vars(ns).copy()
    assert default_topology(ns, cores) == (roles is not None)
    if roles is None:
        assert vars(ns) == before  # the flags (or their absence) decide, as before
        return
    cfg = serve_config_from_args(ns)  # sees a topology now: keeps it
    assert [n for n, _ in cfg.instance_roles] == roles
    assert cfg.instance.engine.threads == threads


@pytest.mark.parametrize(("cores", "roles", "threads"), [
    ((0, 1), ["coupled-0"], 2), ((0, 1, 2, 3), ["prefill-0", "decode-0"], 1)])
def test_serve_config_counts_the_usable_cores(monkeypatch: pytest.MonkeyPatch,
                                              cores: tuple[int, ...], roles: list[str],
                                              threads: int) -> None:
    import yuebing.cli.main as main
    from yuebing.cluster import cli
    from yuebing.cluster.serve import banner

    monkeypatch.setattr(cli, "usable_cpus", lambda: cores)
    cfg = cli.serve_config_from_args(main.build_parser().parse_args(["serve"]))
    assert [n for n, _ in cfg.instance_roles] == roles
    assert cfg.instance.engine.threads == threads
    plan = types.SimpleNamespace(cfg=cfg, stage_flags={}, master_addr="tcp://m:1",
                                 base_url="http://b:2")
    said = banner(plan, types.SimpleNamespace(log_dir="/logs"), "m")  # type: ignore[arg-type]
    assert said.startswith("yuebing serve: ready (1 coupled on 2 threads, store" if threads == 2
                           else "yuebing serve: ready (1 prefill + 1 decode, store")


@pytest.mark.parametrize(("cuda", "roles"), [(False, ["coupled-0"]),
                                             (True, ["prefill-0", "decode-0"])])
def test_device_auto_counts_as_the_cpu_where_torch_sees_no_cuda(
        monkeypatch: pytest.MonkeyPatch, cuda: bool, roles: list[str]) -> None:
    import torch

    import yuebing.cli.main as main
    from yuebing.cluster.cli import default_topology

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    ns = main.build_parser().parse_args(["serve", "--device", "auto"])
    assert default_topology(ns, 2) == (roles == ["coupled-0"])


@pytest.mark.parametrize(("flags", "mixed"), [
    ([], 0.09), (["--tbt-slo", "0.2"], 0.18), (["--tbt-slo", "0.2", "--mixed-step-s", "0.05"], 0.05),
    (["--mixed-step-s", "0"], 0.0)])
def test_a_mixed_step_follows_the_tbt_slo_unless_given(flags: list[str], mixed: float) -> None:
    """A prefill chunk beside running decodes is sized to 90 % of the TBT SLO (the engine's
    default: of the default 100 ms); ``--mixed-step-s`` overrides it, and the instances get it."""
    import yuebing.cli.main as main
    from yuebing.cluster.cli import serve_config_from_args

    cfg = serve_config_from_args(main.build_parser().parse_args(["serve", *flags]))
    assert cfg.instance.engine.mixed_step_s == pytest.approx(mixed)
    passed = config_args(cfg.instance, skip=MANAGED["instance"])
    assert ("--mixed-step-s" in passed) == (mixed != 0.09)


def test_taken_fixed_ports_are_refused_before_anything_starts() -> None:
    import socket

    from yuebing.cluster.serve import check_ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port: cannot listen on 127.0.0.1:{port} "
                                              r"\(Address already in use\)"):
            check_ports(ServeConfig(port=port))
        with pytest.raises(ConfigError, match=r"--store-port.*: cannot listen on 127.0.0.1:"):
            check_ports(ServeConfig(port=0, store_port=port - 1))
        check_ports(ServeConfig(port=0, store=False, store_port=port))  # no store: not used


TINY4 = "dummy:preset=tiny,layers=4"


def test_cpp_group_plan_gives_stages_their_layers(tmp_path: Path) -> None:
    cfg = ServeConfig(prefill=3, decode=1, cpp_group=2, store=False, instance=InstanceConfig(
        engine=dataclasses.replace(InstanceConfig().engine, model=TINY4, max_batch_tokens=256)),
        conductor=ConductorConfig(model=TINY4))
    plan = ServePlan(cfg, tmp_path)
    argv = {s.name: s.argv for st in plan.stages() for s, _ in st}
    assert argv["prefill-0"][-4:] == ("--layers", "0:2", "--cpp-group", "cpp-0")
    assert argv["prefill-1"][-4:] == ("--layers", "2:4", "--cpp-group", "cpp-0")
    assert "--layers" not in argv["prefill-2"] and "--layers" not in argv["decode-0"]
    # a whole-model twin beside each stage, on the stage's machine (group and range)
    assert argv["twin-0"][-4:] == ("--twin-of", "0:2", "--cpp-group", "cpp-0")
    assert argv["twin-1"][-4:] == ("--twin-of", "2:4", "--cpp-group", "cpp-0")
    assert "twin-2" not in argv  # prefill-2 is a single instance: no twin
    bare = ServePlan(dataclasses.replace(cfg, cpp_twins=False), tmp_path)
    assert not any(s.name.startswith("twin") for st in bare.stages() for s, _ in st)
    with pytest.raises(ConfigError, match="a twin is a whole-model prefill instance"):
        InstanceConfig(role="decode", cpp_group="g", twin_of="0:2")
    with pytest.raises(ConfigError, match="not a range A:B"):
        InstanceConfig(role="prefill", cpp_group="g", twin_of="x")
    with pytest.raises(ConfigError, match="names its stage"):
        InstanceConfig(role="prefill", cpp_group="g")
    conductor = argv["conductor"]
    assert conductor[conductor.index("--cpp-threshold-tokens") + 1] == "256"
    assert conductor[conductor.index("--cpp-chunk-tokens") + 1] == "256"
    with pytest.raises(ConfigError, match="a group is 2 or more"):
        ServeConfig(prefill=1, decode=1, cpp_group=2)
    with pytest.raises(ConfigError, match="one range per stage"):
        ServeConfig(prefill=2, decode=1, cpp_group=2, cpp_layers="0:4")


@pytest.mark.parametrize(("ranges", "says"), [
    ("0:2,1:4", "layer ranges 0:2, 1:4 overlap at 1:2"),
    ("0:1,2:4", "layer ranges 0:1, 2:4 leave a gap at 1:2"),
    ("0:2,2:6", "layers '2:6' reach past the model's 4 layers (0:4)"),
])
def test_serve_refuses_bad_group_ranges_with_one_line(tmp_path: Path, ranges: str,
                                                      says: str) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "yuebing.cli.main", "serve", "--log-dir",
                          str(tmp_path / "logs"), "--model", TINY4, "--prefill", "2",
                          "--decode", "1", "--cpp-group", "2", "--cpp-layers", ranges],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == f"yuebing: error: {says}", out.stderr
    assert not (tmp_path / "logs").exists()
