"""``yuebing serve --engine vllm``: the plan starts ``yuebing vllm instance`` per
instance (with its role, the store master and a port for its vLLM), and refuses what is not
built yet."""

from __future__ import annotations

from dataclasses import replace

import pytest

from yuebing.cluster.serve import ServeConfig, ServePlan
from yuebing.core.errors import ConfigError
from yuebing.instance.config import DEFAULT_ENGINE, InstanceConfig


def test_vllm_instances_are_started_through_the_adapter(tmp_path):
    plan = ServePlan(ServeConfig(coupled=1, engine="vllm"), tmp_path)
    spec, _ = plan.instance("coupled-0", "coupled")
    argv = list(spec.argv)
    at = argv.index("vllm")
    assert argv[at:at + 2] == ["vllm", "instance"]
    assert argv[argv.index("--master") + 1] == plan.master_addr
    assert argv[argv.index("--control-port") + 1] == str(plan.control["coupled-0"])
    assert argv[argv.index("--store-block-tokens") + 1] == "256"
    assert "--vllm-port" in argv and "serve" not in argv
    assert argv[argv.index("--role") + 1] == "coupled"
    assert "--no-startup-profile" not in argv and "--dtype" not in argv  # vLLM's float32
    bf16 = ServeConfig(coupled=1, engine="vllm",
                       instance=InstanceConfig(engine=replace(DEFAULT_ENGINE, dtype="bfloat16")))
    a = list(ServePlan(bf16, tmp_path).instance("coupled-0", "coupled")[0].argv)
    assert a[a.index("--dtype") + 1] == "bfloat16"
    quick = ServeConfig(coupled=1, engine="vllm",
                        instance=InstanceConfig(startup_profile=False))  # passed on, not refused
    assert "--no-startup-profile" in ServePlan(quick, tmp_path).instance("coupled-0",
                                                                          "coupled")[0].argv
    pd = ServePlan(ServeConfig(prefill=1, decode=1, engine="vllm"), tmp_path)
    roles = []
    for name, role in pd.cfg.instance_roles:
        a = list(pd.instance(name, role)[0].argv)
        roles.append(a[a.index("--role") + 1])
    assert roles == ["prefill", "decode"]
    etcd = ServePlan(ServeConfig(prefill=1, engine="vllm", etcd="http://127.0.0.1:2379",
                                 cluster="c1"), tmp_path)
    a = list(etcd.instance("prefill-0", "prefill")[0].argv)
    assert a[a.index("--etcd") + 1] == "http://127.0.0.1:2379"
    assert a[a.index("--cluster") + 1] == "c1"


def test_what_vllm_instances_cannot_do_yet_is_refused():
    threads = InstanceConfig(engine=replace(DEFAULT_ENGINE, threads=2))
    for bad in ({"coupled": 1, "store": False},
                {"coupled": 1, "instance": threads}):
        with pytest.raises(ConfigError, match="--engine vllm runs vLLM instances next to"):
            ServeConfig(engine="vllm", **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="given: --threads 2"):
        ServeConfig(engine="vllm", coupled=1, instance=threads)
    with pytest.raises(ConfigError, match="--engine must be yuebing or vllm"):
        ServeConfig(coupled=1, engine="sglang")
    assert ServeConfig(coupled=1).engine == "yuebing"


def test_the_engines_cpu_priority_reaches_every_instance(tmp_path):
    import argparse

    from yuebing.core.config import add_config_args, config_from_args
    from yuebing.integrations.vllm.instance import VllmInstanceConfig

    def argv(cfg: ServeConfig) -> list[str]:
        name, role = cfg.instance_roles[0]
        return list(ServePlan(cfg, tmp_path).instance(name, role)[0].argv)

    # the default (nice +10) is each instance's own default: nothing to pass
    assert "--engine-nice" not in argv(ServeConfig(coupled=1, engine="vllm"))
    off = InstanceConfig(engine_nice=0, engine_idle=True)
    for engine in ("vllm", "yuebing"):
        a = argv(ServeConfig(coupled=1, engine=engine, instance=off))
        assert a[a.index("--engine-nice") + 1] == "0" and "--engine-idle" in a
    a = argv(ServeConfig(coupled=1, engine="vllm", instance=off))
    p = argparse.ArgumentParser()
    add_config_args(p, VllmInstanceConfig)
    p.add_argument("--log-dir")  # `yuebing vllm instance`'s own
    p.add_argument("--ready-file")
    parsed = config_from_args(VllmInstanceConfig, p.parse_args(a[a.index("instance") + 1:]))
    assert parsed.priority.nice == 0 and parsed.priority.idle
    assert VllmInstanceConfig().priority.nice == InstanceConfig().priority.nice == 10
    for bad in (-1, 20):
        with pytest.raises(ValueError, match=f"--engine-nice must be in 0..19 .*got {bad}"):
            InstanceConfig(engine_nice=bad)
        with pytest.raises(ValueError, match=f"--engine-nice must be in 0..19 .*got {bad}"):
            VllmInstanceConfig(engine_nice=bad)


def test_the_vllm_instances_of_a_host_get_disjoint_cpus(tmp_path, monkeypatch):
    import argparse

    import yuebing.cluster.serve as serve
    from yuebing.core.config import add_config_args, config_from_args
    from yuebing.integrations.vllm.instance import VllmInstanceConfig

    def cpus(cfg: ServeConfig) -> dict[str, str]:
        plan = ServePlan(cfg, tmp_path)
        out = {}
        for name, role in cfg.instance_roles:
            a = list(plan.instance(name, role)[0].argv)
            out[name] = a[a.index("--cpus") + 1]
        return out

    monkeypatch.setattr(serve, "usable_cpus", lambda: (0, 1))
    assert cpus(ServeConfig(prefill=1, decode=1, engine="vllm")) == {"prefill-0": "0",
                                                                     "decode-0": "1"}
    assert cpus(ServeConfig(coupled=1, engine="vllm")) == {"coupled-0": "0-1"}
    # every instance the same share (a role's instances must match: the thread count is part
    # of the engine configuration the predictor check compares); the rest is the control plane's
    monkeypatch.setattr(serve, "usable_cpus", lambda: (0, 1, 2, 3))
    assert cpus(ServeConfig(prefill=2, decode=1, engine="vllm")) == {
        "prefill-0": "0", "prefill-1": "1", "decode-0": "2"}
    monkeypatch.setattr(serve, "usable_cpus", lambda: (0, 1, 2))
    assert cpus(ServeConfig(coupled=2, engine="vllm")) == {"coupled-0": "0", "coupled-1": "1"}
    monkeypatch.setattr(serve, "usable_cpus", lambda: (2, 3, 4, 5, 6, 7, 9))
    assert cpus(ServeConfig(prefill=2, decode=1, engine="vllm")) == {
        "prefill-0": "2-3", "prefill-1": "4-5", "decode-0": "6-7"}
    assert "--cpus" not in ServePlan(ServeConfig(coupled=1), tmp_path).instance(
        "coupled-0", "coupled")[0].argv  # yuebing's engine: not pinned
    monkeypatch.undo()
    # what the plan passes, `yuebing vllm instance` takes: one thread per CPU of its share
    plan = ServePlan(ServeConfig(prefill=1, decode=1, engine="vllm"), tmp_path)
    a = list(plan.instance("decode-0", "decode")[0].argv)
    p = argparse.ArgumentParser()
    add_config_args(p, VllmInstanceConfig)
    p.add_argument("--log-dir")
    p.add_argument("--ready-file")
    parsed = config_from_args(VllmInstanceConfig, p.parse_args(a[a.index("instance") + 1:]))
    assert parsed.cpus == plan.cpus["decode-0"]
    assert parsed.omp_threads == len(parsed.cpu_set())
