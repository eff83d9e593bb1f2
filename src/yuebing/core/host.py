"""This processor as the predictors name it (`cpu_name`): yuebing's engine signature
(`engine.runtime.machine`) and a vLLM instance's start-up profile (`integrations.vllm.profile`)
both put it, with their thread count, in the configuration a profile holds for. `speed` times
the host now (a Python loop, a memory copy): ``benchmarks/overload_live.py`` and
``benchmarks/engine_peers.py`` record it before and after a run, since a virtual machine's
speed moves between phases that no configuration names."""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass

_ISA = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_name() -> str:
    """``model name | best matmul ISA`` from /proc/cpuinfo (a profile taken on one processor
    predicts only that one)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    isa = next((i for i in _ISA if i in flags), "baseline")
    return f"{model} | {isa}"


@dataclass(frozen=True)
class HostSpeed:
    """The host's speed at one moment: ns per iteration of a plain Python loop (the control
    paths: RPC, scheduling) and one thread's copy rate in GB/s (decode reads its weights)."""

    python_ns: float
    copy_gbps: float

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items()}


def speed(loops: int = 1_000_000, copy_bytes: int = 64 << 20, repeats: int = 3) -> HostSpeed:
    """The best of ``repeats`` timings of each probe (~0.5 s in all on a 2-core Xeon)."""
    def loop() -> float:
        t, total = time.perf_counter(), 0
        for i in range(loops):
            total += i
        return time.perf_counter() - t

    src, dst = bytearray(b"\x01") * copy_bytes, bytearray(copy_bytes)
    dst[:] = src  # fault the pages in before timing (a slice assignment is one memmove)

    def copy() -> float:
        t = time.perf_counter()
        dst[:] = src
        return time.perf_counter() - t

    py = min(loop() for _ in range(repeats))
    cp = min(copy() for _ in range(repeats))
    return HostSpeed(python_ns=py / loops * 1e9, copy_gbps=copy_bytes / cp / 1e9)
