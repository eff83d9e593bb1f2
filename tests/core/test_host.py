"""The host's name and speed probes (`core.host`)."""

from __future__ import annotations

import math

from yuebing.core.host import HostSpeed, cpu_name, speed


def test_cpu_name_names_the_model_and_its_best_matmul_isa() -> None:
    model, sep, isa = cpu_name().rpartition(" | ")
    assert sep and model
    assert isa in {"amx_bf16", "avx512_bf16", "avx512f", "avx2", "baseline"}


def test_speed_times_both_probes_and_rounds_them_for_reports() -> None:
    s = speed(loops=20_000, copy_bytes=1 << 20, repeats=2)
    assert math.isfinite(s.python_ns) and 0.1 < s.python_ns < 10_000
    assert math.isfinite(s.copy_gbps) and 0.01 < s.copy_gbps < 10_000
    assert HostSpeed(12.34567, 5.0).as_dict() == {"python_ns": 12.346, "copy_gbps": 5.0}
