"""What an engine measures at start-up (the ``auto`` attention paths, the fused decode's rows,
the matmul route per projection shape and row count), shared by every process of one machine
(`core.choices`); called by `LLMEngine`, timed with `interleaved_times`.

Two instances of one cluster that pick differently run two engine configurations (the Conductor
then refuses the second's predictor), so the first process measures and the others read. The
key covers the machine (`core.choices.machine_parts`), torch, threads and `VERSION` (always) and
what the caller names (kernel build, shape, dtype, candidates), so any change measures again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from yuebing.core import choices

T = TypeVar("T")

VERSION = 3
"""Of the engine's choice set: raised when a choice's candidates or meaning change (2: the
matmul routes; the machine named by `core.choices.machine_parts`; 3: candidates run in an
order reversed every other round, routes decided on paired ratios)."""


def shared_choice(parts: dict[str, object], measure: Callable[[], T],
                  parse: Callable[[Any], T], root: Path | None = None) -> tuple[T, bool]:
    """`core.choices.shared_choice` for ``parts`` on this machine, torch and thread count;
    never measured again once kept (the engine's configuration follows from it)."""
    here = {**choices.machine_parts(), "engine_choices": VERSION, "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    return choices.shared_choice({**here, **parts}, measure, parse, root, remeasure=False)


def interleaved_samples(fns: dict[str, Callable[[], object]], device: torch.device,
                        rounds: int) -> dict[str, list[float]]:
    """Seconds of each candidate in each of ``rounds`` rounds (after one untimed warm-up call
    each). The candidates of a round run back to back, in the given order in even rounds and
    reversed in odd ones: a burst of load from another process slows every candidate of that
    round alike instead of deciding the choice, and a position effect (the first of a round ran
    10-20 % slower in loaded tests here) falls on each candidate equally."""
    def once(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for fn in fns.values():
        fn()  # warm-up (first-call allocation, kernel loading)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            samples[name].append(once(fns[name]))
    return samples


def interleaved_times(fns: dict[str, Callable[[], object]], device: torch.device,
                      rounds: int, reduce: Callable[[list[float]], float] = statistics.median
                      ) -> dict[str, float]:
    """Median (or ``reduce``) seconds of each candidate over `interleaved_samples`' rounds
    (timing the candidates one after the other is the suspected cause of a benchmark run whose
    prefill was 1.8x slower than the next)."""
    return {name: reduce(v) for name, v in interleaved_samples(fns, device, rounds).items()}


def paired_ratios(samples: dict[str, list[float]], name: str, base: str) -> list[float]:
    """``name``'s time over ``base``'s in each round, sorted: the two ran back to back, so a slow
    phase of the host moves both sides of a ratio."""
    return sorted(a / b for a, b in zip(samples[name], samples[base], strict=True) if b > 0)


def attention_choice(raw: Any) -> tuple[str, str, dict[str, float]]:
    """`choose_attention`'s (decode, prefill, timings) from JSON."""
    decode, prefill, timings = raw
    if not (isinstance(decode, str) and isinstance(prefill, str) and isinstance(timings, dict)):
        raise TypeError(f"not an attention choice: {raw!r}")
    return decode, prefill, {str(k): float(v) for k, v in timings.items()}


def rows_choice(raw: Any) -> tuple[int, dict[str, float]]:
    """`fused_decode.choose_max_rows`'s (rows, timings) from JSON."""
    rows, timings = raw
    if not (isinstance(rows, int) and isinstance(timings, dict)):
        raise TypeError(f"not a fused-decode choice: {raw!r}")
    return rows, {str(k): float(v) for k, v in timings.items()}


def routes_choice(raw: Any) -> tuple[dict[str, list[int]], dict[str, float]]:
    """`linear.choose_routes`' (plain-route row counts per shape, timings), or `choose_amx`'s
    (AMX row counts per projection), from JSON."""
    plain, timings = raw
    if not (isinstance(plain, dict) and isinstance(timings, dict)
            and all(isinstance(v, list) and all(isinstance(r, int) for r in v)
                    for v in plain.values())):
        raise TypeError(f"not a matmul route choice: {raw!r}")
    return {str(k): list(v) for k, v in plain.items()}, {str(k): float(v)
                                                        for k, v in timings.items()}
