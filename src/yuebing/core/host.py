"""This processor as the predictors name it (`cpu_name`): yuebing's engine signature
(`engine.runtime.machine`) and a vLLM instance's start-up profile (`integrations.vllm.profile`)
both put it, with their thread count, in the configuration a profile holds for."""

from __future__ import annotations

import platform

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
