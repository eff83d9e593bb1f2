"""Building and loading yuebing's native CPU kernels (``csrc/*.cpp`` → ``torch.ops.yuebing.*``);
`load` is called by the first engine whose ``kernels`` is ``auto`` or ``native``, and ahead of
time by ``yuebing engine build-kernels``.

A built library is cached under a key hashing everything it depends on (sources, flags, torch,
venv, compiler, this CPU), so checkouts, venvs, compilers and machines never share a build.
`load` loads a cached one at once, else builds it under a file lock into a private directory
and moves it into place atomically. It reports success or failure, never raises.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from yuebing.core import env

log = logging.getLogger(__name__)

SOURCES = ("common.h", "vec.h", "tiles.h", "decode_attention.h", "decode_attention.cpp",
           "decode_fused.cpp", "flash_prefill.cpp", "layer_ops.cpp", "amx_linear.cpp", "register.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
OPS = ("paged_decode_attention", "rms_norm", "fused_add_rms_norm", "rope_write_kv",
       "silu_and_mul", "flash_prefill_attention", "decode_layer", "decode_logits", "amx_linear")


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
    return CFLAGS + env.kernels_cflags()


@functools.lru_cache(maxsize=8)
def _compiler_version(compiler: str | None) -> str:
    """First line of ``<compiler> --version`` ("" when there is none or it does not run)."""
    if compiler is None:
        return ""
    try:
        proc = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (proc.stdout.splitlines() or [""])[0]


def build_key() -> str:
    """Hash of everything the compiled library depends on (raises OSError if a source is
    unreadable)."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((source_dir() / name).read_bytes())
    compiler = _compiler()
    for part in (" ".join(cflags() + LDFLAGS), torch.__version__, os.path.dirname(torch.__file__),
                 str(source_dir()), sys.prefix, env.compiler(), str(compiler),
                 _compiler_version(compiler), _cpu_identity()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Parent of the build directories (``$XDG_CACHE_HOME/yuebing/kernels`` or ~/.cache/...)."""
    return env.cache_home() / "yuebing" / "kernels"


def _compiler() -> str | None:
    return shutil.which(env.compiler() or "c++")


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
            env.prepend_path(scripts)


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing); the kernel releases it
    when this process closes it or dies, so a stale lock file never blocks anyone."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building the native kernels (%s)", path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _compile(key: str, library: Path) -> str:
    """Build (and load) the library in a private temporary directory, then move it to
    ``library`` atomically; "" on success, else the reason. Call with the key's lock held."""
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    tmp = library.parent.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a dead process that had this pid
    tmp.mkdir()
    log.info("building the native kernels in %s (first use on this machine, ~30 s)", tmp)
    sources = [str(source_dir() / n) for n in SOURCES if n.endswith(".cpp")]
    try:
        cpp_extension.load(name=library.stem, sources=sources, extra_cflags=list(cflags()),
                           extra_ldflags=list(LDFLAGS), build_directory=str(tmp),
                           is_python_module=False, verbose=False)
        library.parent.mkdir(exist_ok=True)
        os.replace(tmp / library.name, library)
    except (RuntimeError, OSError, ImportError, ValueError) as exc:
        return (f"building the native kernels in {tmp} failed: "
                f"{_first_error(str(exc)) or repr(exc)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ""


PRUNE_AFTER_S = 14 * 86400
"""Other builds in the cache not used for this long are removed after a new build."""


def prune(root: Path, keep: str, older_than_s: float = PRUNE_AFTER_S) -> list[Path]:
    """Remove the entries of the kernel cache ``root`` other than key ``keep``'s (its build
    directory and lock) that were last used more than ``older_than_s`` ago (a build directory's
    mtime is refreshed on every load); returns what was removed. Errors skip the entry."""
    cutoff = time.time() - older_than_s
    removed = []
    for entry in root.iterdir():
        if entry.name.startswith(keep):
            continue
        try:
            if entry.stat().st_mtime >= cutoff:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        removed.append(entry)
    return removed


def _load_or_build(key: str, library: Path) -> str:
    """Load ``library``, building it first (under the key's lock) when no process has; "" on
    success, else the reason. A new build prunes long-unused builds of other keys."""
    if not library.exists():
        with _exclusive(library.parent.with_name(f"{key}.lock")):
            if not library.exists():  # another process may have built it while we waited
                error = _compile(key, library)
                if not error:
                    for entry in prune(library.parent.parent, key):
                        log.info("removed unused kernel build %s", entry)
                return error
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        return f"loading the native kernels from {library} failed: {exc}"
    with contextlib.suppress(OSError):
        os.utime(library.parent)  # last use, for `prune`
    return ""


def _build() -> BuildResult:
    if platform.system() != "Linux":
        return BuildResult(False, None, f"native kernels are built on Linux only, not "
                                        f"{platform.system()}")
    if _compiler() is None:
        return BuildResult(False, None, "no C++ compiler found (install g++ or set CXX)")
    try:
        key = build_key()
    except OSError as exc:
        return BuildResult(False, None, f"cannot read the kernel sources in {source_dir()}: "
                                        f"{exc}")
    root = cache_dir()
    library = root / key / f"yuebing_kernels_{key}.so"
    try:
        root.mkdir(parents=True, exist_ok=True)
        error = _load_or_build(key, library)
    except OSError as exc:
        error = (f"cannot use the kernel cache {root}: {exc}; set XDG_CACHE_HOME to a "
                 f"writable directory")
    if error:
        return BuildResult(False, None, error)
    missing = [op for op in OPS if not hasattr(torch.ops.yuebing, op)]
    if missing:
        return BuildResult(False, None, f"the native kernel library lacks operators {missing}")
    return BuildResult(True, library)


def load() -> BuildResult:
    """Build (if needed) and load the kernels once per process; the result is cached.

    The cached library (``<cache>/yuebing/kernels/<key>/yuebing_kernels_<key>.so``) loads with
    ``torch.ops.load_library`` in ~50 ms. Otherwise the process takes an ``fcntl.flock`` on
    ``<key>.lock`` (dropped by the kernel if the holder dies), looks again, compiles with
    ``torch.utils.cpp_extension.load`` (``-O3 -march=native``) in ``<key>.tmp-<pid>`` and
    ``os.replace``s the result into place, so readers see no library or a complete one (~30 s on 2
    cores). The failure reason is cached for the process; an unwritable cache is a failure."""
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
