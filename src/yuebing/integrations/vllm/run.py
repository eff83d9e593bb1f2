"""`run_vllm_instance`: the process behind ``yuebing vllm instance`` — starts the vLLM server
(unless one is given), takes its start-up profile (`profile.vllm_profile`), serves
`instance.VllmInstance` until SIGTERM/SIGINT, stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path

from yuebing.core.auth import adopt_cluster_token
from yuebing.instance import profile_cache
from yuebing.integrations.vllm.instance import ROLES, VllmInstance, VllmInstanceConfig
from yuebing.integrations.vllm.profile import (
    VllmProbe,
    given_hardware,
    server_version,
    signature,
    started_hardware,
    vllm_profile,
)
from yuebing.integrations.vllm.server import (
    LOADING_STOP_S,
    STOP_S,
    VllmEnv,
    VllmServer,
    VllmServerConfig,
)
from yuebing.ops.ports import free_port
from yuebing.protocol.instance import EngineProfile

log = logging.getLogger(__name__)


def _write_ready(path: str, data: dict[str, object]) -> None:
    if path:
        tmp = path + ".tmp"
        Path(tmp).write_text(json.dumps(data))
        os.replace(tmp, path)


def find_master(cfg: VllmInstanceConfig, timeout_s: float = 60.0) -> str:
    """The store leader named in etcd (``--etcd`` without ``--master``), waited for up to
    ``timeout_s`` (the store may start after this instance); SystemExit if none comes."""
    from yuebing.cluster.discovery import Discovery, DiscoveryError

    disc = Discovery(cfg.etcd, cfg.cluster)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            master = disc.store_master()
        except DiscoveryError as e:
            master, why = "", str(e)
        else:
            why = "no store leader elected"
        if master:
            print(f"store master {master} (from etcd {cfg.etcd})", flush=True)
            return master
        if time.monotonic() >= deadline:
            raise SystemExit(f"no store master in etcd {cfg.etcd} cluster {cfg.cluster!r} "
                             f"after {timeout_s:.0f} s ({why}); start `yuebing store master "
                             f"--etcd {cfg.etcd}` or give --master")
        time.sleep(0.5)


def run_vllm_instance(cfg: VllmInstanceConfig, ready_file: str = "",
                      log_dir: Path | None = None) -> int:
    env = VllmEnv()
    adopt_cluster_token(cfg.cluster_token)  # the store clients here and in vLLM present it
    if cfg.etcd and not cfg.master:
        cfg = dataclasses.replace(cfg, master=find_master(cfg))
    if not cfg.model_dir:
        cfg = dataclasses.replace(cfg, model_dir=str(env.model))
    server, loading = None, contextlib.ExitStack()
    if not cfg.vllm_url and cfg.kv_events_port == 0:
        cfg = dataclasses.replace(cfg, kv_events_port=free_port("127.0.0.1"))
    if not cfg.vllm_url and cfg.kv_replay_port == 0 and cfg.kv_events_port > 0:
        cfg = dataclasses.replace(cfg, kv_replay_port=free_port("127.0.0.1"))
    if not cfg.vllm_url:
        why = env.missing()
        if why:
            raise SystemExit(f"cannot start vLLM: {why}")
        scfg = VllmServerConfig(port=cfg.vllm_port, master=cfg.master,
                                served_name=cfg.served_name, dtype=cfg.dtype,
                                block_size=cfg.block_size,
                                store_block_tokens=cfg.store_block_tokens,
                                max_model_len=cfg.max_model_len, threads=cfg.omp_threads,
                                cpus=cfg.cpu_set(), lend_cpus=cfg.lend_cpus(),
                                kv_events_port=max(0, cfg.kv_events_port),
                                kv_replay_port=max(0, cfg.kv_replay_port),
                                priority=cfg.priority)
        logs = log_dir or Path(tempfile.mkdtemp(prefix="yb-vllm-"))
        # SIGTERM while vLLM loads (a supervisor's ready timeout) ends this process through
        # the `finally` below, which stops vLLM's process group: it leads a session of its own
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        loading.enter_context(profile_cache.starting())  # no sibling profiles while it loads
        server = VllmServer(scfg, logs / f"{cfg.instance_id}.vllm.log", env)
    try:
        if server is not None:
            log.info("starting vLLM on %s (log %s)", server.url, server.log_path)
            server.wait_ready()
            loading.close()
            cfg = started_config(cfg, server.url)
        engine, profile = startup_profile(
            cfg, started=server is not None,
            lend_cores=len(server.cfg.lend_cpus) if server is not None else 0)
        return asyncio.run(_serve(cfg, ready_file, server, engine, profile))
    finally:
        if server is not None:  # one still loading may not act on SIGTERM: killed soon
            server.stop(timeout_s=STOP_S if cfg.vllm_url else LOADING_STOP_S)
        loading.close()


def started_config(cfg: VllmInstanceConfig, url: str) -> VllmInstanceConfig:
    """``cfg`` once the vLLM it started answers at ``url``: relayed to like one at
    ``--vllm-url``, with the OpenMP threads it was started with (its profile's key)."""
    return dataclasses.replace(cfg, vllm_url=url, accelerator="cpu", cpus="",
                               threads=cfg.omp_threads)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def startup_profile(cfg: VllmInstanceConfig, started: bool, lend_cores: int = 0
                    ) -> tuple[dict[str, str], EngineProfile | None]:
    """The running vLLM's configuration (`profile.signature`: ``started`` here, or at
    ``--vllm-url`` on the ``--accelerator`` named) and, unless ``--no-startup-profile``, its
    start-up profile (cached or measured now); SystemExit naming the cause when vLLM does not
    answer or the profile fails."""
    layout = cfg.layout()
    hardware = (started_hardware(cfg.omp_threads, lend_cores) if started
                else given_hardware(cfg.accelerator))
    try:
        version = server_version(cfg.vllm_url)
        sig = signature(version, cfg.served_name, cfg.dtype, cfg.block_size,
                        layout.fingerprint(), hardware)
        if not cfg.startup_profile:
            return sig, None
        hf = json.loads((Path(cfg.model_dir) / "config.json").read_text())
        probe = VllmProbe(cfg.vllm_url, cfg.served_name, int(hf["vocab_size"]))
        return sig, vllm_profile(probe, ROLES[cfg.role], sig, cfg.max_model_len)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise SystemExit(f"start-up profile of vLLM at {cfg.vllm_url} failed: "
                         f"{type(e).__name__}: {e} (--no-startup-profile skips it)") from e


async def _serve(cfg: VllmInstanceConfig, ready_file: str, server: VllmServer | None,
                 engine: dict[str, str], profile: EngineProfile | None) -> int:
    """Serve until SIGTERM/SIGINT (0), or until the vLLM server this process started exits
    (1: the instance is gone with it; under ``yuebing serve`` the supervisor restarts both)."""
    inst = VllmInstance(cfg, engine, profile)
    job = asyncio.get_running_loop().create_task(inst.serve())
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, job.cancel)
    lost = False

    async def watch() -> None:
        nonlocal lost
        while server is not None and server.proc.poll() is None:
            await asyncio.sleep(0.5)
        if server is not None:
            lost = True
            log.error("vLLM exited with %s; this instance ends with it", server.proc.returncode)
            job.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    publication = None
    if cfg.etcd:  # as `yuebing serve prefill|decode|coupled --etcd` (instance.run)
        from yuebing.cluster.discovery import Discovery
        publication = await asyncio.to_thread(
            Discovery(cfg.etcd, cfg.cluster).publish_instance, cfg.instance_id, inst.hello(0))
    _write_ready(ready_file, {"control_address": inst.address, "vllm_url": cfg.vllm_url,
                              "fingerprint": inst.layout.fingerprint(), "pid": os.getpid()})
    print(f"vLLM instance {cfg.instance_id} on {inst.address} relaying to {cfg.vllm_url}",
          flush=True)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await job
    finally:
        watcher.cancel()
        if publication is not None:
            with contextlib.suppress(Exception):
                publication.close()
    return 1 if lost else 0
