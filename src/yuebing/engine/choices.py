"""What an engine measures at start-up (the ``auto`` attention paths, the fused decode's rows),
shared by every process of one machine; called by `LLMEngine`.

Timing under load can tip a close race either way, and two instances of one cluster that pick
differently run two engine configurations (the Conductor then refuses the second's predictor).
So the first process measures, under a file lock, and keeps the choice in
``$XDG_CACHE_HOME/yuebing/choices/<key>.json``; the others read it. The key covers the machine,
torch and threads (always) and what the caller names (kernel build, shape, dtype, candidates), so
any change measures again (as does deleting the directory). An unusable cache is logged and
the choice measured anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from yuebing.core import env
from yuebing.engine.runtime import machine

log = logging.getLogger(__name__)

T = TypeVar("T")


def choice_dir() -> Path:
    return env.cache_home() / "yuebing" / "choices"


def choice_key(parts: dict[str, object]) -> str:
    """The cache key of ``parts`` on this machine: its processor, torch and thread count are
    always part of it."""
    here = {"machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    what = json.dumps({**here, **parts}, sort_keys=True, default=str)
    return hashlib.blake2b(what.encode(), digest_size=10).hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path, parse: Callable[[Any], T]) -> T | None:
    try:
        return parse(json.loads(path.read_text())["value"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        log.warning("start-up choice %s unreadable (%s); measuring again", path, e)
    return None


def shared_choice(parts: dict[str, object], measure: Callable[[], T],
                  parse: Callable[[Any], T], root: Path | None = None) -> tuple[T, bool]:
    """The machine's choice for ``parts`` (and True), or ``measure()``'s, kept for the next
    process (and False). ``parse`` turns the kept JSON back into a choice, raising
    ValueError, KeyError, TypeError or IndexError on a malformed one (measured again)."""
    try:
        base = root or choice_dir()
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{choice_key(parts)}.json"
        with _locked(base / ".lock"):
            found = _read(path, parse)
            if found is not None:
                return found, True
            choice = measure()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"value": choice, "parts": parts}, default=str,
                                      indent=1))
            os.replace(tmp, path)
            return choice, False
    except (OSError, RuntimeError) as e:  # read-only cache, no home directory
        log.warning("start-up choice: no usable cache (%s); measuring without it", e)
        return measure(), False


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
