"""Process-level runtime choices made once when an engine starts (`setup`).

Device ``auto`` → CUDA when available, else CPU (the same model code runs on both). Dtype
``auto`` → bfloat16 on CUDA and on CPUs with native bf16 instructions (AVX512-BF16 / AMX),
float32 otherwise. ``torch.set_num_threads`` is always set explicitly (`choose_threads`: on a
CPU shared with busy processes, OpenMP's spinning threads can make two threads far slower than
one). The KV pool gets transparent huge pages where the kernel allows (`advise_hugepages`) and
glibc malloc keeps large freed blocks (`tune_malloc`). `machine` names this processor for the
predictors. `release_openmp_pool` hands the engine's OpenMP threads to the thread that steps it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time
from pathlib import Path

import torch

from yuebing.core.choices import machine_parts
from yuebing.core.errors import ConfigError
from yuebing.engine.config import EngineConfig, default_threads

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_tuned = False


def tune_malloc(threshold: int = 1 << 30) -> bool:
    """Keep freed large blocks in the heap (glibc ``mallopt``: mmap and trim thresholds), so
    large temporary tensors are not returned to the OS and page-faulted back in on every layer;
    returns whether it applied (a no-op on other C libraries)."""
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    _tuned = ok
    return ok


_MADV_HUGEPAGE = 14
_HUGE = 1 << 21


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask the kernel for transparent huge pages under ``t``'s storage (CPU, Linux; call before
    the memory is first touched). Decode attention reads the KV pool in scattered 2 KiB pieces
    (one block of one head); on 4 KiB pages nearly each piece costs a TLB miss. Returns whether
    the advice was taken (False on other systems, small tensors, or THP disabled)."""
    if t.device.type != "cpu" or t.nbytes < 2 * _HUGE:
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    start = (t.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
    end = (t.data_ptr() + t.nbytes) & ~(_HUGE - 1)
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return end > start and libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def libtorch_cpu() -> ctypes.CDLL:
    """torch's ``libtorch_cpu`` (``OSError`` where it cannot be loaded): dlsym on its handle
    also finds what it links (MKL's CBLAS, its OpenMP runtime), whatever those files are
    called."""
    return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's OpenMP runtime as `libtorch_cpu` resolves it (the libgomp its parallel regions
    run on), its two calls typed; None where torch runs another runtime."""
    try:
        lib = libtorch_cpu()
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]  # libgomp of GCC 9+
        lib.omp_pause_resource_all.restype = ctypes.c_int
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
    except (OSError, AttributeError) as exc:
        log.debug("libgomp's omp_pause_resource_all unavailable (%s)", exc)
        return None
    return lib


def release_openmp_pool() -> bool:
    """Stop the calling thread's OpenMP worker threads (libgomp's ``omp_pause_resource_all``
    frees only the caller's pool, if it has one) and run its later torch parallel regions on
    it alone; False where torch runs another OpenMP runtime or the call fails (never raises:
    thread pools run it as their initializer).

    libgomp keeps a pool of workers per thread that has run a parallel region, and once the
    pools together hold more threads than the process may use CPUs, every barrier waits in a
    futex instead of spinning (``gomp_throttled_spin_count_var``): a 2-thread decode step then
    sleeps and wakes ~200 times and takes ~2x as long. An instance builds and profiles its
    engine on its main thread and steps it on the driver thread, so the main thread releases
    its pool before the driver starts; the instance's helper threads that copy tensors (store
    loads and saves, pipeline-stage rows) call it as they start. Only this thread's OpenMP
    setting changes (``omp_set_num_threads(1)``): torch's default for other threads stays."""
    lib = _libgomp()
    if lib is None:
        return False
    try:
        torch.get_num_threads()  # torch's first call on a thread sets it to torch's default: now
        lib.omp_set_num_threads(1)
        return lib.omp_pause_resource_all(2) == 0  # omp_pause_hard
    except Exception as exc:  # noqa: BLE001  (a thread pool's initializer must not raise)
        log.warning("could not release this thread's OpenMP pool: %s", exc)
        return False


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def machine() -> str:
    """This machine as the predictors name it: the processor and the cores this process may
    use, the same `core.choices.machine_parts` that key the start-up choices (a profile taken
    on one machine predicts only that one)."""
    parts = machine_parts()
    return f"{parts['cpu']} | {parts['cpus']} cores"


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda requested but torch sees no CUDA device; use --device cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" or cpu_has_bf16() else "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def _time_threads(threads: int, dtype: torch.dtype, repeats: int = 30) -> float:
    torch.set_num_threads(threads)
    x = torch.randn(8, 576).to(dtype)
    w = torch.randn(1536, 576).to(dtype)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.nn.functional.linear(torch.nn.functional.silu(x), w)
        best = min(best, time.perf_counter() - t0)
    return best


def choose_threads(requested: int, dtype: torch.dtype) -> int:
    """``requested`` if > 0, else 1 or all usable cores, whichever runs a matmul loop faster."""
    if requested > 0:
        return requested
    cores = default_threads()
    if cores == 1:
        return 1
    one, many = _time_threads(1, dtype), _time_threads(cores, dtype)
    chosen = cores if many < 0.9 * one else 1
    log.info("threads auto: 1 thread %.2f ms, %s threads %.2f ms -> %s", 1e3 * one, cores,
             1e3 * many, chosen)
    return chosen


def setup(cfg: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """Apply threads and allocator tuning; return the device and dtype to use."""
    tune_malloc()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    threads = choose_threads(cfg.threads, dtype) if device.type == "cpu" else (
        cfg.threads or default_threads())
    torch.set_num_threads(threads)
    log.info("engine runtime: device=%s dtype=%s threads=%s", device, dtype, threads)
    return device, dtype
