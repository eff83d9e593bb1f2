"""What an engine measures at start-up (the ``auto`` attention paths, the fused decode's rows),
shared by every process of one machine (`core.choices`); called by `LLMEngine`.

Two instances of one cluster that pick differently run two engine configurations (the Conductor
then refuses the second's predictor), so the first process measures and the others read. The
key covers the machine, torch and threads (always) and what the caller names (kernel build,
shape, dtype, candidates), so any change measures again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from yuebing.core import choices
from yuebing.engine.runtime import machine

T = TypeVar("T")


def shared_choice(parts: dict[str, object], measure: Callable[[], T],
                  parse: Callable[[Any], T], root: Path | None = None) -> tuple[T, bool]:
    """`core.choices.shared_choice` for ``parts`` on this machine, torch and thread count."""
    here = {"machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    return choices.shared_choice({**here, **parts}, measure, parse, root)


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
