"""`benchmarks/cpp_sim_vs_live.py`: the simulator's single and group TTFT of one long prompt are
the cost model's prefill and the pipeline formula the live group follows (chunks of the stages'
``--max-batch-tokens``, one chunk of bubble and one hand-off per extra stage)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "sim"))
from sim_fakes import LinearCost  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cpp_sim_vs_live.py"


def test_sim_ttfts_follow_the_live_pipeline() -> None:
    spec = importlib.util.spec_from_file_location("cpp_sim_vs_live", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    single, group = mod.sim_ttfts(LinearCost(), 8000, 2, 512, 2304)
    assert single == pytest.approx(8.0)  # 1 ms per token
    # 16 chunks of 512: 8 s / 2 · (1 + 1/16), one 512-row hand-off at 1 GB/s
    assert group == pytest.approx(8.0 / 2 * (1 + 1 / 16) + 512 * 2304 / 1e9)
    # the quiet live run: 17.03 s single, 9.13 s group (0.536); the formula gives 0.531
    assert group / single == pytest.approx(9.13 / 17.03, rel=0.02)
