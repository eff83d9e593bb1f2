"""The engine benchmark's workload and measurement method, shared by every peer.

``benchmarks/engine_peers.py`` serializes a :class:`Workload` to JSON and starts a worker per
peer (``run_vllm.py`` / ``run_transformers.py`` in the peers venv, ``run_ours.py`` here). Each
wraps its runtime in a :class:`Backend` and calls :func:`main`: ``--serve`` warms up, says READY
and takes one :func:`sample` per stdin command (:func:`serve`); ``--out`` runs :func:`measure`.
A sample: decode ms/step at batch B = (T(1 + steps tokens) - T(1 token)) / steps on B fresh
prompts each; prefill tokens/s at L = L / T(1 token) on one fresh prompt. Prompts come from the
sample's tag (no prefix cache can hit), and every call must return exactly ``max_tokens`` tokens
per sequence (EOS ignored). Only ``Backend.generate`` differs between peers.

Stdlib only: this module is imported from two different virtualenvs.
"""

from __future__ import annotations

import abc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any


class WorkloadError(ValueError):
    """A workload value is out of range (the message says which and what to use)."""


@dataclass(frozen=True)
class Workload:
    """What to measure. Field defaults follow issue 5's targets."""

    batches: tuple[int, ...] = (1, 8, 32)
    decode_prompt_len: int = 128
    decode_steps: int = 64
    prefill_lens: tuple[int, ...] = (512, 2048)
    repeats: int = 3
    seed: int = 1234
    token_low: int = 100  # lowest token id used (skips SmolLM2's special tokens 0..16)
    token_high: int = 49000  # exclusive; SmolLM2's vocabulary has 49152 entries
    dtype: str = "bfloat16"
    threads: int = 2
    kv_gib: float = 2.0  # KV cache space given to vLLM and to our engine
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _need(len(self.batches) > 0 and all(b >= 1 for b in self.batches),
              f"batches must be positive integers, got {self.batches}")
        _need(self.decode_prompt_len >= 1, f"decode_prompt_len must be >= 1, got {self.decode_prompt_len}")
        _need(self.decode_steps >= 1, f"decode_steps must be >= 1, got {self.decode_steps}")
        _need(all(n >= 1 for n in self.prefill_lens), f"prefill_lens must be >= 1, got {self.prefill_lens}")
        _need(self.repeats >= 1, f"repeats must be >= 1, got {self.repeats}")
        _need(0 <= self.token_low < self.token_high,
              f"need 0 <= token_low < token_high, got {self.token_low}, {self.token_high}")
        _need(self.dtype in ("bfloat16", "float32"), f"dtype must be bfloat16 or float32, got {self.dtype!r}")
        _need(self.threads >= 1, f"threads must be >= 1, got {self.threads}")
        _need(self.kv_gib > 0, f"kv_gib must be > 0, got {self.kv_gib}")

    @property
    def max_len(self) -> int:
        """Longest sequence any call creates (prompt + generated tokens)."""
        return max(max(self.prefill_lens) + 1, self.decode_prompt_len + 1 + self.decode_steps)

    @property
    def batch_tokens(self) -> int:
        """Token budget of one engine step given to vLLM and ours: a whole prefill fits."""
        return max(max(self.prefill_lens), max(self.batches) * self.decode_prompt_len)

    @property
    def total_calls(self) -> int:
        """Number of timed ``generate`` calls :func:`measure` makes (for progress bars)."""
        return self.repeats * (2 * len(self.batches) + len(self.prefill_lens))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        raw = json.loads(text)
        raw["batches"] = tuple(raw["batches"])
        raw["prefill_lens"] = tuple(raw["prefill_lens"])
        return cls(**raw)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise WorkloadError(message)


def make_prompts(w: Workload, count: int, length: int, tag: str) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` token ids, a pure function of (seed, tag)."""
    rng = random.Random(f"{w.seed}:{tag}")
    return [[rng.randrange(w.token_low, w.token_high) for _ in range(length)] for _ in range(count)]


class Backend(abc.ABC):
    """One runtime under test, driven in the peer's own subprocess by :func:`measure` and by
    the worker loop (`serve`, `sample`)."""

    name: str = "?"

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """Greedy-generate exactly ``max_tokens`` tokens for every prompt as one batch, ignoring
        EOS; block until done; return the number of tokens generated per prompt."""

    def describe(self) -> dict[str, Any]:
        """Versions and settings recorded beside the numbers."""
        return {}


def progress(done: int, total: int, label: str) -> None:
    """Tell the parent harness how far we are (one parseable stdout line)."""
    print(f"PROGRESS {done} {total} {label}", flush=True)


class _Timer:
    """Times one ``generate`` call, checks its token counts and reports progress."""

    def __init__(self, backend: Backend, total: int, quiet: bool = False) -> None:
        self.backend, self.total, self.done, self.quiet = backend, total, 0, quiet

    def run(self, prompts: list[list[int]], max_tokens: int, label: str) -> float:
        t0 = time.perf_counter()
        counts = self.backend.generate(prompts, max_tokens)
        elapsed = time.perf_counter() - t0
        if list(counts) != [max_tokens] * len(prompts):
            raise RuntimeError(
                f"{self.backend.name}: asked for {max_tokens} tokens x {len(prompts)} prompts, "
                f"got {list(counts)} (EOS not ignored?)")
        self.done += 1
        if not self.quiet:
            progress(self.done, self.total, label)
        return elapsed


CELLS = ("decode", "prefill")
"""Kinds of measurement: decode ms/step at a batch size, prefill tokens/s at a prompt length."""


def cells(w: Workload) -> list[tuple[str, int]]:
    """Every (kind, size) the workload measures, in report order."""
    return [("decode", b) for b in w.batches] + [("prefill", n) for n in w.prefill_lens]


def warm_up(backend: Backend, w: Workload) -> None:
    """Untimed first calls: they allocate caches, pick kernels, compile."""
    backend.generate(make_prompts(w, 1, w.decode_prompt_len, "warm-d"), 4)
    backend.generate(make_prompts(w, max(w.batches), w.decode_prompt_len, "warm-b"), 2)
    backend.generate(make_prompts(w, 1, max(w.prefill_lens), "warm-p"), 1)


def sample(timer: _Timer, w: Workload, kind: str, size: int, tag: str) -> float:
    """One sample of a cell on fresh prompts named by ``tag``: decode ms/step at batch ``size``
    or prefill tokens/s at ``size`` prompt tokens."""
    if kind == "decode":
        short = timer.run(make_prompts(w, size, w.decode_prompt_len, f"{tag}s"), 1,
                          f"decode b={size}")
        long = timer.run(make_prompts(w, size, w.decode_prompt_len, f"{tag}l"),
                         1 + w.decode_steps, f"decode b={size}")
        return 1000.0 * (long - short) / w.decode_steps
    if kind == "prefill":
        return size / timer.run(make_prompts(w, 1, size, tag), 1, f"prefill {size}")
    raise WorkloadError(f"cell kind must be one of {CELLS}, got {kind!r}")


def measure(backend: Backend, w: Workload) -> dict[str, Any]:
    """Run the whole workload through ``backend`` alone; return the result document."""
    timer = _Timer(backend, w.total_calls)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    warm_up(backend, w)
    decode: dict[str, Any] = {}
    for b in w.batches:
        steps = [sample(timer, w, "decode", b, f"d{b}r{r}") for r in range(w.repeats)]
        med = statistics.median(steps)
        decode[str(b)] = {"ms_per_step": med, "tokens_per_s": b * 1000.0 / med if med > 0 else None,
                          "samples_ms": steps}
    prefill: dict[str, Any] = {}
    for n in w.prefill_lens:
        rates = [sample(timer, w, "prefill", n, f"p{n}r{r}") for r in range(w.repeats)]
        prefill[str(n)] = {"tokens_per_s": statistics.median(rates), "samples_tokens_per_s": rates}
    return {
        "peer": backend.name,
        "info": backend.describe(),
        "workload": json.loads(w.to_json()),
        "decode": decode,
        "prefill": prefill,
        "wall_s": time.perf_counter() - t_start,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def serve(backend: Backend, w: Workload, commands: IO[str], replies: IO[str]) -> int:
    """Worker mode: warm up, write ``READY <describe() as JSON>``, then per command line
    ``{"kind": K, "size": S, "tag": T}`` take one :func:`sample` and write
    ``SAMPLE {"value": V, "seconds": wall}``; ``quit`` or end of input ends it (0). A bad
    command or a failed call writes ``ERROR <reason>`` and returns 1."""
    warm_up(backend, w)
    replies.write("READY " + json.dumps(backend.describe()) + "\n")
    replies.flush()
    timer = _Timer(backend, 0, quiet=True)
    for line in commands:
        if line.strip() in ("", "quit"):
            break
        try:
            cmd = json.loads(line)
            t0 = time.perf_counter()
            value = sample(timer, w, cmd["kind"], int(cmd["size"]), str(cmd["tag"]))
            reply = {"value": value, "seconds": time.perf_counter() - t0}
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            replies.write(f"ERROR {type(exc).__name__}: {exc} (command {line.strip()!r})\n")
            replies.flush()
            return 1
        replies.write("SAMPLE " + json.dumps(reply) + "\n")
        replies.flush()
    return 0


def main(make_backend: Any) -> int:
    """Entry point of a peer script: ``--workload JSON --model PATH`` and either ``--serve``
    (commands on stdin, replies on stdout: :func:`serve`) or ``--out PATH`` (:func:`measure`)."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, help="Workload as JSON (see workload.py)")
    p.add_argument("--out", help="where to write the result JSON of the whole workload")
    p.add_argument("--serve", action="store_true",
                   help="take samples as commanded on stdin (engine_peers.py's workers)")
    p.add_argument("--model", required=True, help="model path (HF dir, or GGUF for ours)")
    ns = p.parse_args()
    if bool(ns.out) == ns.serve:
        p.error("give exactly one of --out and --serve")
    w = Workload.from_json(ns.workload)
    backend = make_backend(ns.model, w)
    if ns.serve:
        # the peer's own log lines may go to stdout: replies stay on their own lines
        return serve(backend, w, sys.stdin, sys.stdout)
    result = measure(backend, w)
    with open(ns.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"{backend.name}: done in {result['wall_s']:.0f}s", file=sys.stderr)
    return 0
