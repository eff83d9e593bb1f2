"""Figure 8: prefill GPU time per request (conversation trace, 16 nodes).

From the four runs of Figure 1 (Mooncake 8P+8D and the three coupled baselines on 16
instances, trace replayed at `fig1.SPEED`): the prefill GPU-seconds of every request divided by
the requests. Mooncake's count every node of a pipeline group and include the schedule overhead
and cache load; a coupled instance's prefill steps are shared among their requests by prompt
tokens (`yuebing.sim.vllm_instance`).
"""

from __future__ import annotations

from pathlib import Path

from yuebing.sim.paper import fig1
from yuebing.sim.paper.common import paired_bars, run, save_figure
from yuebing.sim.runner import load_systems
from yuebing.sim.system import SYSTEMS

PAPER = {"mooncake": 1.06, "vllm": 1.66, "vllm_prefix_caching": 1.52,
         "vllm_chunked_prefill": 2.02}
"""Paper Figure 8, seconds per request (read off the plot)."""


def compute(trace_path: str | Path, fast: bool = False) -> dict[str, float | None]:
    """{system: mean prefill GPU seconds per request}."""
    load_systems()
    out: dict[str, float | None] = {}
    for name in fig1.SYSTEM_NAMES:
        if name not in SYSTEMS:
            out[name] = None
            continue
        summary = run(trace_path, fig1.config(name, fast)).summary
        out[name] = float(summary["prefill_gpu_s"]) / int(summary["requests"])  # type: ignore[arg-type, call-overload]
    return out


def ratios(values: dict[str, float | None]) -> dict[str, float | None]:
    """Each system's value divided by Mooncake's."""
    base = values.get("mooncake")
    return {k: (v / base if v is not None and base else None) for k, v in values.items()}


def plot(result: dict[str, float | None], out_dir: str | Path) -> list[Path]:
    names = [n for n in fig1.SYSTEM_NAMES if result.get(n) is not None]
    fig = paired_bars(names, {n: float(result[n] or 0.0) for n in names}, PAPER,
                      "prefill GPU time per request (s)",
                      "Figure 8: prefill GPU time per request (16 nodes, conversation)", (8, 4))
    return [save_figure(fig, out_dir, "fig8_prefill_gpu_time.png")]
