"""What the Conductor's policy predicts with, kept true to the instances it routes to.

`Calibration.admit` (asked by `LiveCluster` per joining `Hello`): with ``--predictors FILE`` an
instance must run the configuration the file was profiled on; without one, the first start-up
profile of a role sets that part's predictor and later instances must match it, and its lent
points give the prefill's speed on borrowed cores (`prefill_factor`, per instance's threads).
`observe` scales the prefill predictor by finished prefills' time over their estimate. From
finished requests, in place of flags: `DecodeDurations` (the forecast's decode durations) and
`TbtTail` (paper TBT per step predicted for the batch the request decoded in, from the
`StepLedger` of the decode instances' load reports). Changes reach the policy through
``on_change``.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace

from yuebing.conductor.policy import (
    BivariatePolynomial,
    DecodePredictor,
    Predictors,
    PrefillPredictor,
)
from yuebing.conductor.policy.decode import duration_quantiles
from yuebing.conductor.policy.predictors import ATTENTION_TERMS
from yuebing.conductor.policy.tail import (
    TAIL_LIMITS,
    TAIL_QUANTILE,
    TAIL_WINDOW,
    min_tail_samples,
    tail_ratio,
)
from yuebing.core.errors import InputError
from yuebing.protocol.instance import EngineProfile, Hello, Role
from yuebing.trace.latency import nearest_rank

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
MIN_OBSERVED_S = 0.05
"""Prefills estimated shorter than this do not move the scale (fixed costs dominate them)."""
ALPHA = 0.3
"""Decay of the scale's sums per finished prefill: the newest counts most."""
PRIOR_S = 2.0
"""The profile's own evidence in the scale: this many seconds of prefill at ratio 1 (a first
short prompt, its fixed costs above the fit, moves the scale little; a long one, much)."""
RESCALE_STEP = 0.05
"""The policy takes a new scale once it moved this much (relative) from the one in force."""
SCALE_LIMITS = (0.25, 4.0)
LENT_LIMITS = (0.1, 1.0)
"""A prefill on borrowed cores is predicted at most this much faster, and never slower."""


def _parts(role: Role) -> tuple[str, ...]:
    return {Role.PREFILL: (PREFILL,), Role.DECODE: (DECODE,)}.get(role, (PREFILL, DECODE))


def describe(configuration: Mapping[str, str]) -> str:
    """``k=v, ...`` of a configuration, for messages."""
    return ", ".join(f"{k}={v}" for k, v in sorted(configuration.items())) or "(none recorded)"


def difference(a: Mapping[str, str], b: Mapping[str, str]) -> str:
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return "; ".join(f"{k}: {a.get(k, '-')} vs {b.get(k, '-')}" for k in keys)


def fit_profile(profile: EngineProfile, part: str) -> PrefillPredictor | DecodePredictor:
    """The ``part`` predictor fitted to ``profile`` (prefill: `ATTENTION_TERMS`; decode:
    linear in batch and context)."""
    if part == PREFILL:
        return PrefillPredictor.fit(profile.prefill, exponents=ATTENTION_TERMS)
    return DecodePredictor.fit(profile.decode, degree=1)


def lent_speed(profile: EngineProfile) -> tuple[int, int, float] | None:
    """(own threads, lent threads, factor) of ``profile``: a prefill on the lent threads takes
    ``factor`` of its time on its own, the lent points' total over the same points' own (the
    long prompts weigh most, as in TTFT), within `LENT_LIMITS`; None without lent points, an
    own thread count that lending adds to, or a gain."""
    own = {(n, c): s for n, c, s in profile.prefill}
    pairs = [(s, own[n, c]) for n, c, s in profile.prefill_lent if own.get((n, c), 0) > 0]
    threads = profile.configuration.get("threads", "")
    if not pairs or not threads.isdigit() or not 0 < int(threads) < profile.lent_threads:
        return None
    lo, hi = LENT_LIMITS
    factor = min(max(sum(s for s, _ in pairs) / sum(o for _, o in pairs), lo), hi)
    return (int(threads), profile.lent_threads, factor) if factor < hi else None


def scaled(p: PrefillPredictor, k: float) -> PrefillPredictor:
    poly = p.poly
    return p if k == 1.0 else PrefillPredictor(BivariatePolynomial(
        poly.exponents, tuple(k * c for c in poly.coefficients)))


class Calibration:
    """The predictors in use, per part (prefill, decode) the configuration they hold for."""

    def __init__(self, predictors: Predictors, from_file: str,
                 on_change: Callable[[Predictors], None], online: bool = True,
                 check: str = "refuse") -> None:
        self.predictors = predictors
        self.check = check
        """``refuse`` an instance whose configuration differs, or ``warn`` and route to it."""
        self.on_change = on_change
        self.online = online
        self.base_prefill = predictors.prefill
        """The prefill predictor before the online scale."""
        self.scale = 1.0
        """Live prefill seconds per estimated second, as the policy uses it now."""
        self._sums: tuple[float, float] | None = None
        """Decayed sums of finished prefills' seconds and of their unscaled estimates, the
        prior included (None: nothing learned; the scale is their ratio)."""
        self.lent: tuple[int, int, float] | None = None
        """(own threads, lent threads, factor) of the prefill profile in use: a prefill on
        ``lent`` threads takes ``factor`` of the predicted time (None: not measured)."""
        self.lent_of: dict[str, tuple[int, int, float] | None] = {}
        """Per admitted prefill (or coupled) instance with a start-up profile, its own
        `lent_speed`: hosts differ in cores, and so in what lending gains."""
        self.fixed = bool(from_file)
        """Predictors given (a file): profiles never replace them."""
        origin = f"file {from_file}" if from_file else ""
        self.origin = {PREFILL: origin, DECODE: origin}
        """Where each part's predictor came from ('' = the linear defaults)."""
        known = predictors.configuration if from_file and predictors.configuration else None
        self.pinned: dict[str, Mapping[str, str] | None] = {PREFILL: known, DECODE: known}
        """The configuration each part holds for (None: not known yet)."""
        if from_file and known is None:
            log.warning("predictor file %s records no engine configuration, so it cannot be "
                        "checked against the instances; re-run `yuebing profile` to record it",
                        from_file)

    def state(self) -> dict[str, object]:
        """For ``/health``: each part's origin and the configuration it holds for, the online
        prefill scale and the prefill's speed on lent cores (`lent`)."""
        def shown(lent: tuple[int, int, float] | None) -> dict[str, float] | None:
            return None if lent is None else dict(zip(("own_threads", "lent_threads", "factor"),
                                                      lent, strict=True))
        return {**{part: {"origin": self.origin[part] or "linear defaults",
                          "configuration": dict(self.pinned[part] or {})}
                   for part in (PREFILL, DECODE)}, "prefill_scale": round(self.scale, 4),
                "prefill_lent": shown(self.lent),
                "prefill_lent_by_instance": {i: shown(v) for i, v in sorted(self.lent_of.items())}}

    def prefill_factor(self, step_threads: float, instance_id: str = "") -> float:
        """The prefill time of instance ``instance_id`` when its steps would run with
        ``step_threads`` now, per predicted second: its own profile's lent factor at the lent
        threads (the adopted profile's for an instance without one), linear in the threads
        between its own and those; 1 with no more than its own (or nothing measured)."""
        lent = self.lent_of.get(instance_id, self.lent) if instance_id else self.lent
        if lent is None or step_threads <= lent[0]:
            return 1.0
        own, lent_threads, factor = lent
        return 1.0 + (factor - 1.0) * min(1.0, (step_threads - own) / (lent_threads - own))

    def observe(self, new_tokens: int, cached_tokens: int, prefill_s: float,
                factor: float = 1.0) -> None:
        """A finished prefill computed ``new_tokens`` after ``cached_tokens`` in ``prefill_s``,
        estimated with the instance's `prefill_factor` ``factor``: the scale becomes the ratio
        of the decayed sums of measured and unscaled estimated seconds (`PRIOR_S` of the
        profile's at ratio 1 to start), and the policy gets a rescaled predictor when it moved
        enough. Weighted by seconds, a long prefill's ratio counts more than a short one's.
        (Against the unscaled prediction: an estimate made under an older scale would feed
        that scale back into the new one.)"""
        if not self.online or new_tokens < 1 or not prefill_s > 0 or not factor > 0:
            return
        base = factor * self.base_prefill.predict(new_tokens, cached_tokens)
        if base * self.scale < MIN_OBSERVED_S:
            return
        lo, hi = SCALE_LIMITS  # one stalled prefill must not hold the scale at its limit
        measured = base * min(max(prefill_s / base, lo), hi)
        num, den = self._sums or (PRIOR_S, PRIOR_S)
        self._sums = num, den = (1 - ALPHA) * num + measured, (1 - ALPHA) * den + base
        k = num / den
        if abs(k / self.scale - 1) <= RESCALE_STEP:
            return
        log.info("prefill predictor scaled by %.3f (live prefills against their estimates)", k)
        self._rescale(k)

    def key(self) -> str:
        """The predictors the learned scale is relative to (the unscaled prefill and the
        decode polynomials), for `learned.configuration`."""
        key = "; ".join(f"{part} {p.poly.exponents} {tuple(f'{c:.6g}' for c in p.poly.coefficients)}"
                        for part, p in ((PREFILL, self.base_prefill),
                                        (DECODE, self.predictors.decode)))
        return key if self.lent is None else f"{key}; lent {self.lent[1]} {self.lent[2]:.6g}"

    def snapshot(self) -> dict[str, object] | None:
        """The learned prefill scale (`learned.LearnedState`)."""
        return {"scale": self._sums[0] / self._sums[1]} \
            if self.online and self._sums is not None else None

    def restore(self, kept: Mapping[str, object]) -> str:
        """Take a kept scale (within `SCALE_LIMITS`; ValueError, changing nothing, if not)."""
        k = kept.get("scale")
        lo, hi = SCALE_LIMITS
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not lo <= k <= hi:
            raise ValueError(f"prefill scale {k!r} is not a number in [{lo}, {hi}]")
        if not self.online:
            return "(not used: --no-predictor-online)"
        self._sums = (float(k) * PRIOR_S, PRIOR_S)  # the kept scale restarts as the prior
        self._rescale(float(k))
        return f"{k:.3f}"

    def reset(self) -> None:
        self._sums = None
        if self.scale != 1.0:
            self._rescale(1.0)

    def _rescale(self, k: float) -> None:
        self.scale = k
        self.predictors = replace(self.predictors, prefill=scaled(self.base_prefill, k))
        self.on_change(self.predictors)

    def admit(self, hello: Hello) -> str:
        """'' if the predictors hold for ``hello``'s instance (adopting its profile where a
        part has none yet), else why it is refused."""
        if hello.layers:  # a pipeline stage: predicted as its share of the whole model
            return ""
        if not hello.engine:
            log.warning("instance %s reports no engine configuration: the predictors (%s) "
                        "cannot be checked against it", hello.instance_id, self.predictors.source)
            return ""
        for part in _parts(hello.role):
            pinned = self.pinned[part]
            if pinned is not None and dict(pinned) != hello.engine:
                fix = ("profile it with `yuebing profile` and pass that file"
                       if self.origin[part].startswith("file ") else
                       "give the Conductor a predictor file (`yuebing profile`)")
                problem = (f"it runs the engine configuration {{{describe(hello.engine)}}}, "
                           f"but the {part} predictor ({self.origin[part]}) holds for "
                           f"{{{describe(pinned)}}} — they differ in "
                           f"{difference(pinned, hello.engine)}. Start it with the same engine "
                           f"flags, or {fix}")
                if self.check == "refuse":
                    return problem + " (--predictor-check warn routes to it anyway)"
                log.warning("instance %s is predicted by another configuration's predictor: %s",
                            hello.instance_id, problem)
        adopted = [p for p in _parts(hello.role) if self.pinned[p] is None]
        if adopted and hello.profile is not None and not self.fixed:
            self._adopt(hello, adopted, hello.profile)
        if PREFILL in _parts(hello.role) and hello.profile is not None:
            self.lent_of[hello.instance_id] = lent_speed(hello.profile)
        else:  # a rejoining id without lent points must not keep its old ones
            self.lent_of.pop(hello.instance_id, None)
        return ""

    def _adopt(self, hello: Hello, parts: list[str], profile: EngineProfile) -> None:
        fits: dict[str, PrefillPredictor | DecodePredictor] = {}
        try:
            fits = {part: fit_profile(profile, part) for part in parts}
        except InputError as e:  # too few points (a tiny model's context cut the grid)
            log.warning("instance %s's start-up profile cannot be fitted (%s); the predictors "
                        "stay %s", hello.instance_id, e, self.predictors.source)
            return
        p = self.predictors
        for part, fit in fits.items():
            self.pinned[part] = dict(profile.configuration)
            self.origin[part] = f"start-up profile of {hello.instance_id}"
            if isinstance(fit, PrefillPredictor):  # a scale learned on the old fit is void
                self.base_prefill, self.scale, self._sums = fit, 1.0, None
                p = replace(p, prefill=fit)
                self.lent = lent_speed(profile)
            else:
                p = replace(p, decode=fit)
        source = "; ".join(f"{part}: {self.origin[part] or 'linear defaults'}"
                           for part in (PREFILL, DECODE))
        self.predictors = replace(p, source=source, configuration=dict(profile.configuration))
        log.info("predictors from %s's start-up profile (%s): %s", hello.instance_id,
                 ", ".join(parts), describe(profile.configuration))
        self.on_change(self.predictors)


DURATION_WINDOW = 256
"""Finished requests whose decode times stand for the distribution (the latest ones)."""
DURATION_QUANTILES = 16
"""Equally likely values of the learned distribution."""
DURATION_EVERY = 16
"""The distribution is refreshed after this many new decode times."""


class DecodeDurations:
    """The decode durations the forecast assumes, learned from finished requests."""

    def __init__(self, on_change: Callable[[tuple[float, ...]], None], learn: bool = True,
                 window: int = DURATION_WINDOW, every: int = DURATION_EVERY,
                 k: int = DURATION_QUANTILES, configured: tuple[float, ...] = (20.0,)) -> None:
        self.on_change = on_change
        self.learn = learn
        self.configured = configured
        """The flag's distribution (``--decode-durations-s``), in use until one is learned."""
        self.every, self.k = every, k
        self.window: deque[float] = deque(maxlen=window)
        self.current: tuple[float, ...] | None = None
        """The distribution handed to the policy (None: still the configured one)."""
        self._new = 0

    def observe(self, seconds: float) -> None:
        """A request decoded for ``seconds`` (its first token to its last); every ``every``
        such times the policy gets the window's `duration_quantiles`."""
        if not self.learn or not (math.isfinite(seconds) and seconds > 0):
            return
        self.window.append(seconds)
        self._new += 1
        if self._new < self.every:
            return
        self._new = 0
        self.current = duration_quantiles(self.window, min(self.k, len(self.window)))
        self.on_change(self.current)

    def snapshot(self) -> dict[str, object] | None:
        """The decode times held (`learned.LearnedState`)."""
        return {"seconds": list(self.window)} if self.learn and self.window else None

    def restore(self, kept: Mapping[str, object]) -> str:
        """Take kept decode times (ValueError, changing nothing, on a malformed list); in use
        at once when there are ``every`` of them."""
        seconds = _numbers(kept.get("seconds"), "decode durations", self.window.maxlen,
                           lambda v: v > 0)
        if not self.learn:
            return "(not used: --no-learn-decode-durations)"
        self.window.clear()
        self.window.extend(seconds)
        self._new = 0
        if len(self.window) >= self.every:
            self.current = duration_quantiles(self.window, min(self.k, len(self.window)))
            self.on_change(self.current)
        return f"{len(self.window)} requests"

    def reset(self) -> None:
        self.window.clear()
        self._new = 0
        if self.current is not None:
            self.current = None
            self.on_change(self.configured)

    def state(self) -> dict[str, object]:
        """For ``/health``: whether it learns, how many times it holds, their mean."""
        n = len(self.window)
        return {"learn": self.learn, "samples": n,
                "mean_s": round(sum(self.window) / n, 4) if n else None,
                "in_use": "learned" if self.current else "configured"}


TAIL_EVERY = 4
"""The tail is recomputed after this many new requests."""


class StepLedger:
    """Each decode instance's predicted step over time, from its load reports: the TBT tail's
    denominator (`mean_step`). The tail is a request's paper TBT per the step predicted for the
    batch it *decoded in* (the time-mean over its decode), not the one it was routed at, which
    would carry the batch's later growth that only admission ``none`` leaves unchecked."""

    def __init__(self, keep_s: float = 900.0) -> None:
        self.keep_s = keep_s
        """How far back the steps are kept (longer than any request's decode: the Conductor
        gives its request timeout and more)."""
        self._times: dict[str, list[float]] = {}
        self._areas: dict[str, list[float]] = {}
        """Per instance: when its step changed, ∫ step dt up to then, and the step from then."""
        self._steps: dict[str, list[float]] = {}

    def record(self, instance: str, step_s: float, now_s: float) -> None:
        """``instance`` steps at ``step_s`` (0: idle) from ``now_s`` (its latest report)."""
        times = self._times.setdefault(instance, [])
        areas = self._areas.setdefault(instance, [])
        steps = self._steps.setdefault(instance, [])
        if times and now_s < times[-1]:
            return
        if steps and steps[-1] == step_s:
            return
        areas.append(areas[-1] + steps[-1] * (now_s - times[-1]) if times else 0.0)
        times.append(now_s)
        steps.append(step_s)
        cut = bisect.bisect_left(times, now_s - self.keep_s) - 1
        if cut > 0 and 2 * cut >= len(times):  # in chunks: a busy instance reports each step
            del times[:cut], areas[:cut], steps[:cut]

    def forget(self, instance: str) -> None:
        """Drop ``instance``'s steps (it died or left: its requests failed with it)."""
        self._times.pop(instance, None)
        self._areas.pop(instance, None)
        self._steps.pop(instance, None)

    def _area(self, instance: str, t: float) -> float | None:
        times = self._times.get(instance)
        if not times or t < times[0]:
            return None
        k = bisect.bisect_right(times, t) - 1
        return self._areas[instance][k] + self._steps[instance][k] * (t - times[k])

    def mean_step(self, instance: str, start_s: float, end_s: float) -> float | None:
        """The time-mean predicted step of ``instance`` over [``start_s``, ``end_s``]; None when
        the interval is empty or begins before its first recorded report."""
        if not end_s > start_s:
            return None
        a, b = self._area(instance, start_s), self._area(instance, end_s)
        return None if a is None or b is None else (b - a) / (end_s - start_s)


class TbtTail:
    """The policy's TBT tail (`PolicyConfig.tbt_tail`), learned from finished requests.

    The SLO is on a request's paper TBT, the mean of its longest tenth of token intervals,
    while the decode predictor gives the mean step: on hosts where a decode step can meet a
    neighbour's prefill, the first runs well above the second. The tail is the ``quantile``
    (nearest rank; by default the SLO's target attainment, 0.9) of paper TBT / predicted step
    (over the request's decode, `StepLedger`) over the last `TAIL_WINDOW` requests, within
    `TAIL_LIMITS`: a request predicted at the SLO then meets it as often as the attainment
    target asks, where a median would miss half."""

    def __init__(self, on_change: Callable[[float], None], learn: bool = True,
                 initial: float = 1.0, window: int = TAIL_WINDOW,
                 min_samples: int | None = None, every: int = TAIL_EVERY,
                 quantile: float = TAIL_QUANTILE) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"the TBT tail quantile must be in (0, 1], got {quantile}")
        if min_samples is None:
            min_samples = min_tail_samples(quantile, window)
        self.on_change = on_change
        self.learn, self.quantile = learn, quantile
        self.initial = initial
        """The flag's tail (``--tbt-tail``), in use until one is learned."""
        self.current = initial
        """The tail the policy uses now."""
        self.window: deque[float] = deque(maxlen=window)
        self.min_samples, self.every = min_samples, every
        self._new = 0

    def observe(self, tbt_s: float, est_step_s: float) -> None:
        """A request finished with paper TBT ``tbt_s`` where the predicted mean step of the
        batch it decoded in was ``est_step_s``; refreshes the tail every ``every`` requests
        once ``min_samples`` are in, and hands it to the policy when it moved by more than
        `RESCALE_STEP`."""
        ratio = tail_ratio(tbt_s, est_step_s) if self.learn else None
        if ratio is None:
            return
        self.window.append(ratio)
        self._new += 1
        if len(self.window) < self.min_samples or self._new < self.every:
            return
        self._new = 0
        tail = nearest_rank(self.window, self.quantile)
        if abs(tail / self.current - 1) <= RESCALE_STEP:
            return
        log.info("TBT tail now %.3f (paper TBT per predicted step, quantile %g of %d requests)",
                 tail, self.quantile, len(self.window))
        self._use(tail)

    def _use(self, tail: float) -> None:
        if tail != self.current:
            self.current = tail
            self.on_change(tail)

    def snapshot(self) -> dict[str, object] | None:
        """The ratios held (`learned.LearnedState`)."""
        return {"ratios": list(self.window)} if self.learn and self.window else None

    def restore(self, kept: Mapping[str, object]) -> str:
        """Take kept ratios (each within `TAIL_LIMITS`; ValueError, changing nothing, if not);
        the tail is their quantile at once when there are ``min_samples`` of them."""
        lo, hi = TAIL_LIMITS
        ratios = _numbers(kept.get("ratios"), "TBT tail ratios", self.window.maxlen,
                          lambda v: lo <= v <= hi)
        if not self.learn:
            return "(not used: --no-learn-tbt-tail)"
        self.window.clear()
        self.window.extend(ratios)
        self._new = 0
        if len(self.window) >= self.min_samples:
            self._use(nearest_rank(self.window, self.quantile))
        return f"{self.current:.3f} ({len(self.window)} requests)"

    def reset(self) -> None:
        self.window.clear()
        self._new = 0
        self._use(self.initial)

    def state(self) -> dict[str, object]:
        """For ``/health``: whether it learns, the tail in use, how many requests it holds."""
        return {"learn": self.learn, "tail": round(self.current, 4), "samples": len(self.window)}


def _numbers(value: object, what: str, most: int | None,
             ok: Callable[[float], bool]) -> list[float]:
    """``value`` as a list of at most ``most`` finite numbers each ``ok``, else ValueError."""
    if not isinstance(value, list) or (most is not None and len(value) > most):
        raise ValueError(f"{what}: not a list of at most {most} numbers")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not ok(v):
            raise ValueError(f"{what}: {v!r} is out of range")
    return [float(v) for v in value]
