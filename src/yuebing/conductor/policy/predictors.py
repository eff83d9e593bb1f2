"""Latency predictors the Conductor policies use to estimate TTFT and TBT.

`yuebing profile` (the real engine) or the simulator (the roofline) produces samples; the
``fit`` of `PrefillPredictor` (a degree-2 polynomial of new and cached tokens, which covers the
paper's FLOPs model exactly), `DecodePredictor` (batch size, total context) and
`TransferPredictor` (overhead + latency + bytes / bandwidth) turns them into coefficients (numpy
least squares, relative error); `Predictors` is the bundle, written and read as a JSON file
(`load_predictors`, `save_predictors`) and handed to `Policy`. A prediction costs ~1 µs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from yuebing.core.config import require
from yuebing.core.errors import InputError

FORMAT: Literal["yuebing-predictors"] = "yuebing-predictors"
VERSION = 1


def poly_exponents(degree: int) -> tuple[tuple[int, int], ...]:
    """All (i, j) with i + j ≤ degree, ordered by total degree then by i descending."""
    require(0 <= degree <= 4, f"polynomial degree must be in 0..4, got {degree}")
    return tuple((i, d - i) for d in range(degree + 1) for i in range(d, -1, -1))


@dataclass(frozen=True, slots=True)
class BivariatePolynomial:
    """``z = Σ_k coefficients[k] · x**exponents[k][0] · y**exponents[k][1]``."""

    exponents: tuple[tuple[int, int], ...]
    coefficients: tuple[float, ...]
    _terms: tuple[tuple[float, int, int], ...] = field(init=False, repr=False, compare=False)
    _degree: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        require(len(self.exponents) > 0, "a polynomial needs at least one term")
        require(len(self.exponents) == len(self.coefficients),
                f"{len(self.exponents)} exponents but {len(self.coefficients)} coefficients")
        require(len(set(self.exponents)) == len(self.exponents), "duplicate exponent pairs")
        for e in self.exponents:
            require(len(e) == 2 and all(isinstance(v, int) and 0 <= v <= 4 for v in e),
                    f"exponent pair {e!r} must be two integers in 0..4")
        require(all(math.isfinite(c) for c in self.coefficients),
                f"coefficients must be finite numbers, got {self.coefficients}")
        terms = tuple((float(c), i, j) for (i, j), c in zip(self.exponents, self.coefficients,
                                                            strict=True) if c != 0.0)
        object.__setattr__(self, "_terms", terms)
        object.__setattr__(self, "_degree", max(max(e) for e in self.exponents))

    def __call__(self, x: float, y: float) -> float:
        if self._degree <= 1:
            xp: tuple[float, ...] = (1.0, x)
            yp: tuple[float, ...] = (1.0, y)
        elif self._degree == 2:
            xp = (1.0, x, x * x)
            yp = (1.0, y, y * y)
        else:
            xp = tuple(x**k for k in range(self._degree + 1))
            yp = tuple(y**k for k in range(self._degree + 1))
        total = 0.0
        for c, i, j in self._terms:
            total += c * xp[i] * yp[j]
        return total

    @classmethod
    def fit(cls, xs: Sequence[float] | np.ndarray, ys: Sequence[float] | np.ndarray,
            zs: Sequence[float] | np.ndarray, exponents: tuple[tuple[int, int], ...], relative: bool = True) -> BivariatePolynomial:
        """Least-squares fit; ``relative`` minimises relative rather than absolute error."""
        x, y, z = (np.asarray(v, dtype=np.float64) for v in (xs, ys, zs))
        if not (x.shape == y.shape == z.shape and x.ndim == 1):
            raise InputError("fit: samples must be equal-length sequences of numbers")
        if not (np.isfinite(x).all() and np.isfinite(y).all() and np.isfinite(z).all()):
            raise InputError("fit: samples contain NaN or infinite values")
        if (x < 0).any() or (y < 0).any() or (z < 0).any():
            raise InputError("fit: samples must be non-negative (token counts, seconds)")
        design = np.stack([x**i * y**j for i, j in exponents], axis=1)
        scale = np.abs(design).max(axis=0)
        scale[scale == 0] = 1.0
        design = design / scale
        if np.linalg.matrix_rank(design) < len(exponents):
            raise InputError(
                f"fit: {len(z)} samples do not determine {len(exponents)} coefficients; "
                "vary both inputs over more distinct values")
        weights = 1.0 / np.maximum(z, 1e-3 * float(z.max()) + 1e-12) if relative else np.ones_like(z)
        coef, *_ = np.linalg.lstsq(design * weights[:, None], z * weights, rcond=None)
        return cls(tuple(exponents), tuple(float(c) for c in coef / scale))

    def to_struct(self) -> PolyFile:
        return PolyFile(list(self.exponents), list(self.coefficients))


def _grid(limit: int, steps: int) -> list[int]:
    """0, then ``steps`` geometrically spaced integers up to ``limit`` (deduplicated)."""
    require(limit >= 1 and steps >= 2, f"grid needs limit ≥ 1 and steps ≥ 2, got {limit}, {steps}")
    pts = np.unique(np.geomspace(1, limit, steps).round().astype(np.int64))
    return [0, *(int(p) for p in pts)]


ATTENTION_TERMS = ((0, 0), (1, 0), (0, 1), (2, 0), (1, 1))
"""Prefill time as its parts grow: a constant, per new token (matmuls), per cached token
(loading it), new² (attention among the new tokens) and new·cached (attention over the
prefix). Two cached lengths determine it; the full degree-2 polynomial needs three."""


@dataclass(frozen=True, slots=True)
class PrefillPredictor:
    """Seconds to prefill ``new_tokens`` on top of ``cached_tokens`` of reused KV."""

    poly: BivariatePolynomial

    def predict(self, new_tokens: float, cached_tokens: float) -> float:
        t = self.poly(new_tokens, cached_tokens)
        return t if t > 0.0 else 0.0

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float]], degree: int = 2,
            relative: bool = True,
            exponents: Sequence[tuple[int, int]] | None = None) -> PrefillPredictor:
        """``samples``: (new tokens, cached tokens, seconds) measurements; every term of the
        given degree, or just ``exponents`` (e.g. `ATTENTION_TERMS`)."""
        n, c, s = _columns(samples, 3, "prefill")
        terms = tuple(exponents) if exponents is not None else poly_exponents(degree)
        return cls(BivariatePolynomial.fit(n, c, s, terms, relative))

    @classmethod
    def from_function(cls, fn: Callable[[int, int], float], max_new_tokens: int = 131072,
                      max_cached_tokens: int = 131072, steps: int = 16,
                      degree: int = 2) -> PrefillPredictor:
        """Fit ``fn(new, cached) -> seconds`` (e.g. a roofline) sampled on a geometric grid."""
        samples = [(n, c, fn(n, c)) for n in _grid(max_new_tokens, steps)[1:]
                   for c in _grid(max_cached_tokens, steps)]
        return cls.fit(samples, degree)


@dataclass(frozen=True, slots=True)
class DecodePredictor:
    """Seconds of one decode step for ``batch_size`` sequences holding ``context_tokens`` in all."""

    poly: BivariatePolynomial

    def predict(self, batch_size: float, context_tokens: float) -> float:
        t = self.poly(batch_size, context_tokens)
        return t if t > 0.0 else 0.0

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float]], degree: int = 1,
            relative: bool = True) -> DecodePredictor:
        """``samples``: (batch size, total context tokens, seconds per step) measurements."""
        b, t, s = _columns(samples, 3, "decode")
        return cls(BivariatePolynomial.fit(b, t, s, poly_exponents(degree), relative))

    @classmethod
    def from_function(cls, fn: Callable[[int, int], float], max_batch: int = 256,
                      max_context_tokens: int = 2_000_000, steps: int = 12,
                      degree: int = 1) -> DecodePredictor:
        """Fit ``fn(batch, context) -> seconds`` sampled on a grid of batch sizes and contexts."""
        samples = [(b, t, fn(b, t)) for b in _grid(max_batch, steps)[1:]
                   for t in _grid(max_context_tokens, steps)[1:] if t >= b]
        return cls.fit(samples, degree)


@dataclass(frozen=True, slots=True)
class TransferPredictor:
    """``seconds = overhead_s + latency + bytes / (bandwidth · efficiency)``."""

    overhead_s: float = 0.0
    efficiency: float = 1.0
    """Share of the nominal link bandwidth a KV transfer achieves."""

    def __post_init__(self) -> None:
        require(math.isfinite(self.overhead_s) and self.overhead_s >= 0,
                f"transfer overhead_s must be ≥ 0, got {self.overhead_s}")
        require(math.isfinite(self.efficiency) and 0 < self.efficiency <= 1.5,
                f"transfer efficiency must be in (0, 1.5], got {self.efficiency}")

    def predict(self, nbytes: float, bandwidth_Bps: float, latency_s: float = 0.0) -> float:
        if nbytes <= 0:
            return 0.0
        return self.overhead_s + latency_s + nbytes / (bandwidth_Bps * self.efficiency)

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float, float]]) -> TransferPredictor:
        """``samples``: (bytes, link bandwidth B/s, link latency s, measured seconds)."""
        nbytes, bw, lat, secs = _columns(samples, 4, "transfer")
        if (bw <= 0).any():
            raise InputError("transfer fit: link bandwidth must be positive")
        ideal = nbytes / bw
        design = np.stack([np.ones_like(ideal), ideal], axis=1)
        if np.linalg.matrix_rank(design) < 2:
            raise InputError("transfer fit: need samples with at least two distinct sizes")
        (overhead, slope), *_ = np.linalg.lstsq(design, secs - lat, rcond=None)
        if slope <= 0:
            raise InputError(f"transfer fit: time does not grow with size (slope {slope:.3g})")
        return cls(overhead_s=max(0.0, float(overhead)), efficiency=min(1.5, 1.0 / float(slope)))


def _columns(samples: Iterable[Sequence[float]], width: int, what: str) -> list[np.ndarray]:
    rows = [tuple(s) for s in samples]
    if not rows:
        raise InputError(f"{what} fit: no samples")
    if any(len(r) != width for r in rows):
        raise InputError(f"{what} fit: every sample must have {width} numbers")
    arr = np.asarray(rows, dtype=np.float64)
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise InputError(f"{what} fit: samples must be finite and non-negative")
    return [arr[:, k] for k in range(width)]


class PolyFile(msgspec.Struct, forbid_unknown_fields=True):
    exponents: list[tuple[int, int]]
    coefficients: list[float]


class TransferFile(msgspec.Struct, forbid_unknown_fields=True):
    overhead_s: float
    efficiency: float


class PredictorFile(msgspec.Struct, forbid_unknown_fields=True):
    """Schema of the predictor file (``yuebing profile`` writes it)."""

    format: Literal["yuebing-predictors"]
    version: int
    prefill: PolyFile
    decode: PolyFile
    transfer: TransferFile
    source: str = ""
    configuration: dict[str, str] = {}
    """The engine configuration profiled (`LLMEngine.signature`); {} in hand-made files."""


@dataclass(frozen=True, slots=True)
class Predictors:
    """The bundle a policy needs; ``source`` says where the fits came from."""

    prefill: PrefillPredictor
    decode: DecodePredictor
    transfer: TransferPredictor
    source: str = ""
    configuration: Mapping[str, str] = field(default_factory=dict)
    """The engine configuration the fits were profiled on ({}: unknown, e.g. a roofline)."""

    def to_json(self) -> str:
        doc = PredictorFile(FORMAT, VERSION, self.prefill.poly.to_struct(),
                            self.decode.poly.to_struct(),
                            TransferFile(self.transfer.overhead_s, self.transfer.efficiency),
                            self.source, dict(self.configuration))
        return msgspec.json.format(msgspec.json.encode(doc).decode(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, origin: str = "<predictors>") -> Predictors:
        """Parse and validate a predictor file; errors name ``origin`` and the bad field."""
        try:
            doc = msgspec.json.decode(text, type=PredictorFile)
        except msgspec.ValidationError as e:
            raise InputError(f"{origin}: invalid predictor file: {e}") from None
        except msgspec.DecodeError as e:
            raise InputError(f"{origin}: not valid JSON: {e}") from None
        if doc.version != VERSION:
            raise InputError(f"{origin}: predictor file version {doc.version} is not supported "
                             f"(this yuebing reads version {VERSION}); re-run `yuebing profile`")
        try:
            return cls(
                PrefillPredictor(_poly(doc.prefill)), DecodePredictor(_poly(doc.decode)),
                TransferPredictor(doc.transfer.overhead_s, doc.transfer.efficiency), doc.source,
                doc.configuration)
        except ValueError as e:
            raise InputError(f"{origin}: invalid predictor file: {e}") from None


def _poly(p: PolyFile) -> BivariatePolynomial:
    return BivariatePolynomial(tuple((int(i), int(j)) for i, j in p.exponents),
                               tuple(p.coefficients))


def load_predictors(path: str | Path) -> Predictors:
    """Read a predictor file (the only file access in this package; never on a decision path)."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise InputError(f"{p}: cannot read predictor file: {e.strerror}") from None
    return Predictors.from_json(text, origin=str(p))


def save_predictors(predictors: Predictors, path: str | Path) -> None:
    """Write ``predictors`` as JSON to ``path``."""
    Path(path).write_text(predictors.to_json())
