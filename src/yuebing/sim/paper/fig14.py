"""Figure 14: latency of single requests, 8k–128k-token prompts, without and with 95 % cached.

The simulator runs Mooncake as 1 prefill + 1 decode node and replays, one at a time (100 s
apart, so nothing queues), a cold request of each prompt length (no cache) and then a request
sharing its first 95 % in whole 512-token blocks (93.75–94.9 % of the prompt), each decoding
128 tokens. From each record: prefill = first token − prefill start (the cached one without
its cache load: the paper's "prefill incl. schedule"), TTFT with transfer and cache load =
KV on the decode node − arrival, total = last token − arrival. The roofline's free choices are
fitted to these rows (`yuebing.sim.calibrate`), so this figure checks that the simulator runs
what the calibration computed.
"""

from __future__ import annotations

from pathlib import Path

from yuebing.sim import calibrate
from yuebing.sim.calibrate import OUTPUT_TOKENS, PROMPTS, ROWS, cached_tokens
from yuebing.sim.metrics import RequestRecord
from yuebing.sim.paper.common import pyplot, save_figure
from yuebing.sim.runner import build_cost_model, simulate
from yuebing.sim.system import SimConfig
from yuebing.sim.workload import SimRequest

LABELS = tuple(f"{n // 1024}k" for n in PROMPTS)
GAP_S = 100.0
"""Seconds between two requests (each runs alone)."""


def workload() -> list[SimRequest]:
    """For each prompt length: a cold request, then one sharing its cached prefix."""
    out: list[SimRequest] = []
    next_key = 0
    for n in PROMPTS:
        blocks = -(-n // 512)
        cold = tuple(range(next_key, next_key + blocks))
        shared = cached_tokens(n) // 512
        warm = cold[:shared] + tuple(range(next_key + blocks, next_key + 2 * blocks - shared))
        next_key += 2 * blocks
        for keys in (cold, warm):
            out.append(SimRequest(len(out), len(out) * GAP_S, n, OUTPUT_TOKENS, keys))
    return out


def config() -> SimConfig:
    return SimConfig(system="mooncake", prefill_nodes=1, decode_nodes=1)


def compute(trace_path: str | Path | None = None, fast: bool = False) -> dict[str, dict[str, float]]:
    """{row: {"8k": s, ...}} (rows of `yuebing.sim.calibrate.ROWS`); the trace is not used."""
    cfg = config()
    cost = build_cost_model(cfg)
    records = simulate(workload(), cfg, cost).records
    out: dict[str, dict[str, float]] = {k: {} for k in ROWS}
    for label, cold, warm in zip(LABELS, records[0::2], records[1::2], strict=True):
        _check_alone(cold, warm)
        load = cost.cache_load_time(warm.hit_tokens)
        out["prefill_no_cache_s"][label] = cold.prefill_s
        out["total_no_cache_s"][label] = cold.finish_s - cold.arrival_s
        out["prefill_cached_s"][label] = warm.prefill_s - load
        out["ttft_cached_s"][label] = warm.kv_ready_s - warm.arrival_s
        out["total_cached_s"][label] = warm.finish_s - warm.arrival_s
    return out


def _check_alone(cold: RequestRecord, warm: RequestRecord) -> None:
    if cold.queue_s > 1e-9 or warm.queue_s > 1e-9 or cold.hit_tokens:
        raise RuntimeError("Figure 14's requests must run alone and the first one cold; "
                           f"got queue {cold.queue_s:g}/{warm.queue_s:g} s, "
                           f"cold hit {cold.hit_tokens}")
    if warm.hit_tokens != cached_tokens(warm.input_tokens):
        raise RuntimeError(f"the warm {warm.input_tokens}-token request reused "
                           f"{warm.hit_tokens} tokens, not its cached prefix")


PAPER: dict[str, dict[str, float]] = {
    k: dict(zip(LABELS, calibrate.PAPER[k], strict=True)) for k in ROWS}
"""Paper Figure 14 in the shape of `compute`'s result."""


def plot(result: dict[str, dict[str, float]], out_dir: str | Path) -> list[Path]:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(LABELS))
    for ax, rows, title in ((axes[0], ("prefill_no_cache_s", "total_no_cache_s"), "no cache"),
                            (axes[1], ("prefill_cached_s", "ttft_cached_s", "total_cached_s"),
                             "95 % cached")):
        for k, row in enumerate(rows):
            color = f"C{k}"
            ax.plot(xs, [result[row][x] for x in LABELS], marker="o", color=color,
                    label=f"{row} (sim)")
            ax.plot(xs, [PAPER[row][x] for x in LABELS], ls="--", marker="x",
                    color=color, label=f"{row} (paper)")
        ax.set_xticks(list(xs), LABELS)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.legend(fontsize=6)
    fig.suptitle("Figure 14: single-request latency (1P+1D, decode 128 tokens)")
    return [save_figure(fig, out_dir, "fig14_single_request.png")]
