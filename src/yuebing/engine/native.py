"""Building and loading yuebing's native CPU kernels (``csrc/*.cpp`` → ``torch.ops.yuebing.*``).

Life cycle: the first engine that resolves ``kernels`` to ``auto`` or ``native`` calls `load`;
it compiles the C++ sources shipped in the package with ``torch.utils.cpp_extension.load``
(``-O3 -march=native``: they are built on the machine that runs them) into a shared library under
``~/.cache/yuebing/kernels/<key>/``, where the key hashes the sources, the flags, the torch
version and this CPU's model and flags (a cache shared between machines never hands one CPU
another's build). Later loads in any process on this machine reuse the library (no compile);
the library registers its operators with ``TORCH_LIBRARY(yuebing, ...)`` when loaded, once per
process. `load` reports success or failure (with the reason, cached for the process);
``yuebing engine build-kernels`` runs it ahead of time so the first request does not pay the
compile (~30–60 s on 2 cores).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = ("common.h", "vec.h", "decode_attention.cpp", "flash_prefill.cpp", "layer_ops.cpp",
           "register.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
OPS = ("paged_decode_attention", "rms_norm", "fused_add_rms_norm", "rope_write_kv",
       "silu_and_mul", "flash_prefill_attention")


@dataclass(frozen=True)
class BuildResult:
    """Outcome of `load`: ``ok`` with the library path, or the reason it is unavailable."""

    ok: bool
    path: Path | None
    error: str = ""


_lock = threading.Lock()
_result: BuildResult | None = None


def source_dir() -> Path:
    """Where the package's C++ sources are (package data ``yuebing/engine/csrc``)."""
    return Path(str(resources.files("yuebing.engine") / "csrc"))


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def cflags() -> tuple[str, ...]:
    """Compiler flags: `CFLAGS` plus the debug knob ``$YUEBING_KERNELS_CFLAGS`` (e.g.
    ``-mno-avx512f`` builds the portable code paths, as on a CPU without AVX-512)."""
    return CFLAGS + tuple(os.environ.get("YUEBING_KERNELS_CFLAGS", "").split())


def build_key() -> str:
    """Hash of everything the compiled library depends on."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((source_dir() / name).read_bytes())
    h.update(" ".join(cflags() + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Parent of the build directories (``$XDG_CACHE_HOME/yuebing/kernels`` or ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "yuebing" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _first_error(text: str) -> str:
    """The compiler's first ``error:`` line of a build log, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    return (errors or lines or [""])[0 if errors else -1]


def _ensure_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; an un-activated venv's own ninja (the pip
    package) is next to this interpreter, so put that directory on PATH when ninja is missing."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        if scripts and shutil.which("ninja", path=scripts):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _build() -> BuildResult:
    if platform.system() != "Linux":
        return BuildResult(False, None, f"native kernels are built on Linux only, not "
                                        f"{platform.system()}")
    if _compiler() is None:
        return BuildResult(False, None, "no C++ compiler found (install g++ or set CXX)")
    _ensure_ninja_on_path()
    from torch.utils import cpp_extension

    key = build_key()
    build_dir = cache_dir() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    name = f"yuebing_kernels_{key}"
    if not (build_dir / f"{name}.so").exists():
        log.info("building the native kernels in %s (first use on this machine, ~30 s)",
                 build_dir)
    sources = [str(source_dir() / n) for n in SOURCES if n.endswith(".cpp")]
    try:
        cpp_extension.load(name=name, sources=sources, extra_cflags=list(cflags()),
                           extra_ldflags=list(LDFLAGS), build_directory=str(build_dir),
                           is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError, ValueError) as exc:
        return BuildResult(False, None, f"building the native kernels in {build_dir} failed: "
                                        f"{_first_error(str(exc)) or repr(exc)}")
    missing = [op for op in OPS if not hasattr(torch.ops.yuebing, op)]
    if missing:
        return BuildResult(False, None, f"the native kernel library lacks operators {missing}")
    return BuildResult(True, build_dir / f"{name}.so")


def load() -> BuildResult:
    """Build (if needed) and load the kernels once per process; the result is cached."""
    global _result
    with _lock:
        if _result is None:
            _result = _build()
            if _result.ok:
                log.info("native kernels loaded from %s", _result.path)
        return _result


def available() -> bool:
    """Whether the kernels are loaded in this process (never builds)."""
    return _result is not None and _result.ok
