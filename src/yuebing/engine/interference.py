"""Interference between two engines sharing one machine (``yuebing profile --interference``;
called by the CLI's ``_run_profile`` after the grid).

Live, a prefill and a decode instance share a host (its cache, memory bandwidth and cores):
each runs slower beside the other than its profile measured alone. `measure_interference`
times decode steps beside a prefilling neighbour process and prefills beside a decoding one,
alone and shared rounds alternating; the factors (shared / alone, geometric means) go into the
samples file (`ProfileSamples.interference`) for the simulator's colocated mode.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Sequence
from multiprocessing.synchronize import Event

from yuebing.core.errors import InputError
from yuebing.engine.engine import LLMEngine
from yuebing.engine.profile import (
    Interference,
    InterferenceSample,
    _Tokens,
    start_decoding,
    time_decode,
    time_prefill,
)

log = logging.getLogger(__name__)
NEIGHBOUR_PREFILL_TOKENS = 1024
"""Prompt length the prefilling neighbour repeats (about the live workload's mean prompt)."""
NEIGHBOUR_DECODE_BATCH = 2
"""Sequences the decoding neighbour keeps in its batch (the live decode batch at the light and
near-saturation rates is one to three)."""
NEIGHBOUR_DECODE_PROMPT = 512
NEIGHBOUR_DECODE_TOKENS = 1024
"""Tokens each of the decoding neighbour's sequences generates before a new batch is started
(its prompts' prefill, a few percent of its time, runs before the first measurement)."""
NEIGHBOUR_START_S = 600.0
"""How long the neighbour may take to load its model and warm up."""
DECODE_STEPS = 24
"""Decode steps timed per point (alone and shared): several neighbour prefills' worth."""


def _neighbour(config: object, phase: str, ready: Event, run: Event, idle: Event,
               stop: Event) -> None:
    """Body of the neighbour process: run ``phase`` back to back while ``run`` is set; between
    units of work (one prefill, one decode step) it checks ``run`` and, when cleared, sets
    ``idle`` and waits."""
    engine = LLMEngine(config)  # type: ignore[arg-type]
    engine.warmup()
    tokens = _Tokens(engine.model_config.vocab_size, seed=1)
    room = engine.max_model_len  # also bounds the KV pool: small test engines get less work
    prefill = min(NEIGHBOUR_PREFILL_TOKENS, room // 2)
    prompt = min(NEIGHBOUR_DECODE_PROMPT, room // 8)
    out = min(NEIGHBOUR_DECODE_TOKENS, room // (2 * NEIGHBOUR_DECODE_BATCH) - prompt)

    def new_batch() -> list[str]:
        return start_decoding(engine, NEIGHBOUR_DECODE_BATCH, prompt, out, tokens)

    rids = new_batch() if phase == "decode" else []
    ready.set()
    parent = mp.parent_process()
    while not stop.is_set():
        if parent is not None and not parent.is_alive():
            return  # the profiler was killed: never outlive it
        if not run.is_set():
            idle.set()
            run.wait(0.05)
            continue
        idle.clear()
        if phase == "prefill":
            time_prefill(engine, prefill, 0, tokens)
        elif any(engine.get_sequence(r) is not None for r in rids):
            engine.step()
        else:
            rids = new_batch()


class _Neighbour:
    """A context manager running `_neighbour` in a spawned process, paused and resumed between
    measurements so alone and shared timings alternate (drift in the machine's other load hits
    both alike)."""

    def __init__(self, config: object, phase: str) -> None:
        ctx = mp.get_context("spawn")
        self.ready, self.run, self.idle, self.stop = (ctx.Event(), ctx.Event(), ctx.Event(),
                                                      ctx.Event())
        self.proc = ctx.Process(target=_neighbour, args=(
            config, phase, self.ready, self.run, self.idle, self.stop), daemon=True,
            name=f"yuebing-neighbour-{phase}")

    def __enter__(self) -> _Neighbour:
        self.proc.start()
        try:
            self._wait(self.ready, "start")
        except BaseException:
            self._end()
            raise
        return self

    def _wait(self, event: Event, what: str) -> None:
        deadline = time.monotonic() + NEIGHBOUR_START_S
        while not event.wait(0.5):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise InputError(f"the interference neighbour did not {what} (exit code "
                                 f"{self.proc.exitcode}; see its traceback above)")

    def __exit__(self, *exc: object) -> None:
        self._end()

    def pause(self) -> None:
        """Stop the neighbour after its current unit of work; returns once it is idle."""
        self.run.clear()
        self._wait(self.idle, "pause")

    def resume(self) -> None:
        self.idle.clear()
        self.run.set()

    def check(self) -> None:
        """Raise `InputError` if the neighbour died."""
        if not self.proc.is_alive():
            raise InputError(f"the interference neighbour died (exit code "
                             f"{self.proc.exitcode}; see its traceback above)")

    def _end(self) -> None:
        self.stop.set()
        self.run.set()
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def geometric_factor(samples: Sequence[InterferenceSample], phase: str) -> float:
    """Geometric mean of shared / alone over the ``phase`` points (1.0 for none)."""
    ratios = [s.shared_s / s.alone_s for s in samples if s.phase == phase and s.alone_s > 0]
    if not ratios:
        return 1.0
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def _time_once(engine: LLMEngine, phase: str, point: tuple[int, int], tokens: _Tokens) -> float:
    """Seconds of one ``phase`` point: a median decode step, or a time to first token."""
    if phase == "decode":
        return time_decode(engine, point[0], point[1], tokens, steps=DECODE_STEPS).wall
    return time_prefill(engine, point[0], point[1], tokens).wall


def measure_interference(engine: LLMEngine, decode_points: Sequence[tuple[int, int]],
                         prefill_points: Sequence[tuple[int, int]], repeats: int = 5,
                         progress: Callable[[str], None] | None = None) -> Interference:
    """Time each decode point alone and beside a prefilling neighbour, each prefill point alone
    and beside a decoding neighbour, alternating alone and shared rounds ``repeats`` times;
    medians per point (see module docstring).

    Decode: the median step time of ``batch`` sequences holding ``context`` tokens, alone and
    beside a neighbour prefilling ``NEIGHBOUR_PREFILL_TOKENS``-token prompts back to back. Prefill:
    the median time to first token of ``new`` tokens, alone and beside a neighbour decoding
    ``NEIGHBOUR_DECODE_BATCH`` sequences. The neighbour is a spawned process with its own
    `LLMEngine` of the same `EngineConfig`, paused (not restarted) between its units of work, so
    drift in the machine's other load affects both kinds of round alike."""
    if not decode_points or not prefill_points:
        raise InputError("interference needs at least one decode and one prefill point")
    if repeats < 1:
        raise InputError(f"interference repeats must be >= 1, got {repeats}")
    tokens = _Tokens(engine.model_config.vocab_size, seed=2)
    samples: list[InterferenceSample] = []
    for phase, other, points in (("decode", "prefill", decode_points),
                                 ("prefill", "decode", prefill_points)):
        alone: list[list[float]] = [[] for _ in points]
        shared: list[list[float]] = [[] for _ in points]
        with _Neighbour(engine.config, other) as neighbour:
            for r in range(repeats):
                if progress:
                    progress(f"interference: {phase} alone / beside a {other} neighbour, "
                             f"round {r + 1}/{repeats}")
                for rounds, running in ((alone, False), (shared, True)):
                    neighbour.resume() if running else neighbour.pause()
                    for k, p in enumerate(points):
                        rounds[k].append(_time_once(engine, phase, p, tokens))
                    if running:
                        neighbour.check()  # "shared" timings beside a dead one would be alone
        samples += [InterferenceSample(phase, list(p), statistics.median(a),
                                       statistics.median(s))
                    for p, a, s in zip(points, alone, shared, strict=True)]
        log.info("interference %s: alone %s s, shared %s s", phase, alone, shared)
    return Interference(geometric_factor(samples, "decode"), geometric_factor(samples, "prefill"),
                        samples, neighbour=f"prefill {NEIGHBOUR_PREFILL_TOKENS} tokens back to "
                        f"back / decode batch {NEIGHBOUR_DECODE_BATCH}, same engine config; "
                        f"alone and shared rounds alternated {repeats} times")
