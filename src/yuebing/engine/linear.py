"""Matmul weights of the model and the route each row count takes; `LlamaModel` wraps each
projection in a `Linear` when it is built and calls it once per layer and step.

On CPU `pack_weight` packs a weight once into oneDNN's blocked layout (``EngineConfig.packed_weights``):
in bf16/fp16 plain ``F.linear`` re-packs it on every call; in fp32 it runs MKL, which on AVX2
AMD processors takes 1.3-3x oneDNN's time (docs/engine.md). At start-up
(`LLMEngine`, cached per machine) `choose_routes` times the packed kernel against ``torch.mm``
per shape and row count (`Linear.use_plain`), then `choose_amx` times the native AMX linear
against that (`Linear.use_amx`, gate/up with SiLU·mul fused: `Linear.silu_mul`). Batch
invariance (`invariant_min_rows`) pads short inputs and keeps one route. Details: docs/engine.md.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from yuebing.engine import amx_linear
from yuebing.engine.choices import interleaved_samples, paired_ratios
from yuebing.engine.kernels import KernelOps

log = logging.getLogger(__name__)

_PACKABLE = (torch.bfloat16, torch.float16, torch.float32)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN weight packing applies to this dtype and device — and works on this CPU
    (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT; tried once per dtype). Prefill row
    counts where ``torch.mm`` runs faster still take it (`choose_routes`)."""
    return (device.type == "cpu" and dtype in _PACKABLE and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and _packs_here(dtype))


@functools.cache
def _packs_here(dtype: torch.dtype) -> bool:
    try:
        w = torch.zeros(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=dtype), packed, None,
                                           "none", [], "")
    except (RuntimeError, NotImplementedError) as exc:
        log.info("oneDNN weight packing does not run here for %s (%s); F.linear instead",
                 dtype, exc)
        return False
    return True


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """The oneDNN-blocked copy of ``weight [out, in]``, or None where packing fails.

    ``batch_hint`` is the row count the layout is tuned for; any row count still computes the
    same product.
    """
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return None
    return packed


class Linear:
    """``y = x @ weight.T + bias``: plain ``F.linear`` or a oneDNN-packed weight."""

    __slots__ = ("amx", "amx_bias", "amx_rows", "amx_silu", "bias", "min_rows", "packed",
                 "plain", "plain_rows", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool = False, batch_hint: int = 16) -> None:
        self.bias = bias
        self.packed = pack_weight(weight, batch_hint) if pack else None
        # the plain weight is only kept where it is used (the packed copy replaces it)
        self.weight = weight if self.packed is None else None
        self.min_rows = 1
        """Inputs of fewer rows are padded to this many (batch invariance; see the module)."""
        self.plain: torch.Tensor | None = None
        """Row-major ``[out, in]`` weight of the plain route beside the packed one."""
        self.plain_rows: tuple[tuple[int, int], ...] = ()
        """Row counts ``[lo, hi)`` that run ``torch.mm`` on `plain` (`use_plain`)."""
        self.amx: torch.Tensor | None = None
        """The weight in the AMX kernel's tiles (`amx_linear.pack`), where `use_amx` set it."""
        self.amx_bias: torch.Tensor | None = None
        self.amx_rows: tuple[tuple[int, int], ...] = ()
        """Row counts ``[lo, hi)`` that run the AMX kernel (before `plain_rows`)."""
        self.amx_silu = False
        """`amx` is a gate/up weight in SiLU pairs: only `silu_mul` runs it."""

    def use_plain(self, weight: torch.Tensor | None, rows: tuple[tuple[int, int], ...]) -> None:
        """Run inputs whose row count lies in one of ``rows`` through ``torch.mm`` on the
        row-major ``weight`` (a packed `Linear` only; ``rows=()`` or None: packed alone)."""
        if self.packed is None or weight is None or not rows:
            self.plain, self.plain_rows = None, ()
            return
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"plain weight {tuple(weight.shape)} is not this {self.shape}")
        self.plain, self.plain_rows = weight, rows

    def use_amx(self, weight: torch.Tensor | None, rows: tuple[tuple[int, int], ...],
                silu: bool = False) -> None:
        """Run inputs whose row count lies in one of ``rows`` through the native AMX linear on
        ``weight [out, in]`` (row-major, packed here); ``silu``: this is the fused gate/up
        projection and only `silu_mul` takes that route. ``rows=()`` or None: off."""
        if weight is None or not rows:
            self.amx, self.amx_bias, self.amx_rows, self.amx_silu = None, None, (), False
            return
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"AMX weight {tuple(weight.shape)} is not this {self.shape}")
        self.amx = amx_linear.pack_silu_pairs(weight) if silu else amx_linear.pack(weight)
        bias = self.bias
        self.amx_bias = None if bias is None else (amx_linear.silu_pairs_order(bias) if silu
                                                   else bias)
        self.amx_rows, self.amx_silu = rows, silu

    def _amx_applies(self, rows: int) -> bool:
        return any(lo <= rows < hi for lo, hi in self.amx_rows)

    def silu_mul(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """``silu(gate)·up`` of this fused gate/up projection of ``x``: one AMX call with the
        SiLU·mul in its store where `use_amx` routed the row count, else ``ops.silu_mul`` of
        the projection."""
        if self.amx_silu and self._amx_applies(x.shape[0]):
            assert self.amx is not None
            return amx_linear.linear(x.contiguous(), self.amx, self.amx_bias,
                                     amx_linear.SILU_MUL)
        return ops.silu_mul(self(x))

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        if self.packed is None:
            assert self.weight is not None
            return (self.weight.shape[0], self.weight.shape[1])
        return (self.packed.size(0), self.packed.size(1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < self.min_rows:
            pad = x.new_zeros((self.min_rows - rows, *x.shape[1:]))
            return self._matmul(torch.cat((x, pad)))[:rows]
        if self.amx is not None and not self.amx_silu and self._amx_applies(rows):
            return amx_linear.linear(x.contiguous(), self.amx, self.amx_bias)
        for lo, hi in self.plain_rows:
            if lo <= rows < hi:
                return self._mm(x)
        return self._matmul(x)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.plain is not None
        if self.bias is None:
            return torch.mm(x, self.plain.t())
        return torch.addmm(self.bias, x, self.plain.t())

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


ROUTE_POINTS = (256, 512, 1024, 2048)
"""Row counts at which `choose_routes` times the routes; each stands for the rows within a
factor √2 of it (fewer or more rows than these cover stay packed)."""


ROUTE_MARGIN = 0.95
"""``torch.mm`` takes a row count only where its time over the packed weight's, round by round,
stays below this in `ROUTE_CONSISTENCY` of the rounds: a near tie or a noisy verdict keeps the
packed weight (the decode's, and no second row-major copy where the fused decode does not
keep one: off, or packed for AMX tiles)."""


ROUTE_CONSISTENCY = 0.75
"""Share of the rounds in which ``torch.mm`` must win by `ROUTE_MARGIN` to take a row count."""


ROUTE_ROUNDS = 9
"""Rounds `choose_routes` times each shape and row count (their ratios decide)."""


ROUTE_WEIGHTS = 8
"""Weights of one shape per timed sample (a model's layers hold one each)."""


def shape_key(lin: Linear) -> str:
    """``"<out>x<in>"``: how route choices name a projection shape."""
    return "x".join(map(str, lin.shape))


def choose_routes(linears: Sequence[tuple[Linear, torch.Tensor]],
                  points: Sequence[int] = ROUTE_POINTS, rounds: int = ROUTE_ROUNDS,
                  seed: int = 0) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Per shape of the packed ``linears`` (each with its row-major weight): the row counts
    of ``points`` at which ``torch.mm`` on the row-major weights beat the packed oneDNN calls
    here (their ratio within a round below `ROUTE_MARGIN` in `ROUTE_CONSISTENCY` of the rounds),
    and every timing (keys ``"<shape>@<rows>_packed|mm"``: medians; ``_ratio``: mm over
    packed, the median of the rounds; ``_ratio_hi``: the round at `ROUTE_CONSISTENCY`, which
    decides). Called once per
    machine by `LLMEngine` outside batch-invariant mode: oneDNN picks its kernel by row count
    and shape, and at some prefill sizes the plain weight's kernel runs faster.

    A sample multiplies one input by `ROUTE_WEIGHTS` weights of the shape in turn, as a
    forward pass does, so they come from beyond the core's cache as they do there (one weight
    timed alone stays in cache, which favours ``torch.mm``: it re-lays its weight out on every
    call). The routes run back to back in `interleaved_samples`' alternating order and are
    compared round by round, so a loaded host's noise does not pick ``torch.mm`` (whole
    prefills on noise-picked routes were no faster: docs/engine.md)."""
    gen = torch.Generator().manual_seed(seed)
    plain: dict[str, list[int]] = {}
    timings: dict[str, float] = {}
    groups: dict[str, list[tuple[Linear, torch.Tensor]]] = {}
    for lin, w in linears:
        if lin.is_packed:
            group = groups.setdefault(shape_key(lin), [])
            if len(group) < ROUTE_WEIGHTS:
                group.append((lin, w))

    def run(x: torch.Tensor, group: list[tuple[Linear, torch.Tensor]], mm: bool) -> None:
        for lin, w in group:
            torch.mm(x, w.t()) if mm else lin._matmul(x)

    with torch.inference_mode():
        for key, group in groups.items():
            w0 = group[0][1]
            for m in points:
                x = torch.randn(m, w0.shape[1], generator=gen).to(w0.dtype)
                if _wins(timings, f"{key}@{m}", w0.device, rounds,
                         ("mm", functools.partial(run, x, group, True)),
                         ("packed", functools.partial(run, x, group, False))):
                    plain.setdefault(key, []).append(m)
    return plain, timings


def _wins(timings: dict[str, float], name: str, device: torch.device, rounds: int,
          new: tuple[str, Callable[[], None]], old: tuple[str, Callable[[], None]]) -> bool:
    """Time ``new`` against ``old`` in ``rounds`` interleaved rounds and record the medians
    (``"<name>_<label>"``) and paired ratios (``_ratio``, ``_ratio_hi``: the one at
    `ROUTE_CONSISTENCY`) in ``timings``; whether ``new`` won by `ROUTE_MARGIN` there."""
    samples = interleaved_samples(dict((old, new)), device, rounds)
    ratios = paired_ratios(samples, new[0], old[0])
    decisive = ratios[min(len(ratios) - 1, int(ROUTE_CONSISTENCY * len(ratios)))]
    timings.update({f"{name}_{k}": statistics.median(v) for k, v in samples.items()})
    timings[f"{name}_ratio"] = statistics.median(ratios)
    timings[f"{name}_ratio_hi"] = decisive
    return decisive < ROUTE_MARGIN


def amx_key(lin: Linear, silu: bool) -> str:
    """How AMX choices name a projection: `shape_key`, ``+silu`` for the gate/up one."""
    return shape_key(lin) + ("+silu" if silu else "")


def choose_amx(linears: Sequence[tuple[Linear, torch.Tensor, bool]], ops: KernelOps,
               points: Sequence[int] = ROUTE_POINTS, rounds: int = ROUTE_ROUNDS,
               seed: int = 0) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Per projection of ``linears`` (each with its row-major weight and whether it is the
    fused gate/up one) whose shape the AMX kernel takes (`amx_linear.fits`): the row counts of
    ``points`` at which the native AMX linear beat the projection's current route (oneDNN, or
    ``torch.mm`` where `use_plain` routed it) here, keyed by `amx_key`; and every timing
    (``"<key>@<rows>_current|amx"``: medians, ``_ratio``/``_ratio_hi`` as in `choose_routes`).
    The gate/up projection is timed with its SiLU·mul: ``ops.silu_mul`` after the current
    route against one AMX call with it fused. Same rounds, margin and consistency as
    `choose_routes`; called once per machine by `LLMEngine` (not in batch-invariant mode)."""
    gen = torch.Generator().manual_seed(seed)
    chosen: dict[str, list[int]] = {}
    timings: dict[str, float] = {}
    groups: dict[str, list[tuple[Linear, torch.Tensor, bool]]] = {}
    for lin, w, silu in linears:
        if amx_linear.fits(lin.shape, w.dtype, w.device, silu):
            group = groups.setdefault(amx_key(lin, silu), [])
            if len(group) < ROUTE_WEIGHTS:
                group.append((lin, w, silu))

    def current(x: torch.Tensor, group: list[tuple[Linear, torch.Tensor, bool]]) -> None:
        for lin, _, silu in group:
            ops.silu_mul(lin(x)) if silu else lin(x)

    def amx(x: torch.Tensor, tiles: list[tuple[torch.Tensor, bool]]) -> None:
        for packed, silu in tiles:
            amx_linear.linear(x, packed, None, amx_linear.SILU_MUL if silu else amx_linear.NONE)

    with torch.inference_mode():
        for key, group in groups.items():
            tiles = [(amx_linear.pack_silu_pairs(w) if silu else amx_linear.pack(w), silu)
                     for _, w, silu in group]
            w0 = group[0][1]
            for m in points:
                x = torch.randn(m, w0.shape[1], generator=gen).to(w0.dtype)
                if _wins(timings, f"{key}@{m}", w0.device, rounds,
                         ("amx", functools.partial(amx, x, tiles)),
                         ("current", functools.partial(current, x, group))):
                    chosen.setdefault(key, []).append(m)
    return chosen, timings


def plain_ranges(points: Sequence[int], chosen: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The row ranges ``[lo, hi)`` that ``chosen`` (a subset of ``points``) stand for:
    within a factor √2 of each; touching ranges merged."""
    out: list[tuple[int, int]] = []
    for p in sorted(points):
        if p not in chosen:
            continue
        lo, hi = math.ceil(p / math.sqrt(2)), math.ceil(p * math.sqrt(2))
        if out and out[-1][1] >= lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


MIN_ROWS_CANDIDATES = (1, 8, 16, 32, 64)
_PROBE_ROWS = (1, 2, 3, 5, 7, 8, 9, 16, 17, 33, 64, 100)
_PROBE_FULL = 256
"""Rows of the reference call."""
_PROBE_ELEMENTS = 32768
"""Output elements checked per probed row count: a changed summation order flips a bf16
output's rounding rarely (about 2 in 10,000 elements), so narrow matmuls check more rows."""
_verdicts: dict[tuple[object, ...], bool] = {}
"""Per process: (shape, dtype, device, packed, threads, candidate) -> invariant."""


def invariant_min_rows(linears: list[Linear], seed: int = 0) -> int | None:
    """The smallest of `MIN_ROWS_CANDIDATES` that makes every matmul in ``linears`` batch
    invariant here (this CPU, library and thread count), or None if none does.

    Called once by `LlamaModel.make_matmuls_invariant` when an engine starts in batch-invariant
    mode. Each distinct weight shape is probed with random rows: with inputs padded to the
    candidate, the first rows multiplied in slices of each row count of `_PROBE_ROWS` must
    equal, bit for bit, the same rows of one `_PROBE_FULL`-row call. Verdicts are kept for the
    process (an engine built again with the same shapes pays nothing).

    oneDNN picks its kernel by row count, and on CPUs with native bf16 (AVX-512 BF16, AMX) the
    kernel for fewer than 8 rows sums over the inner dimension in another order than the one for 8
    or more. Found once per engine; `Linear` then pads smaller inputs up to it (zero rows, dropped
    after), so a decode step of 3 sequences computes exactly like a 2,000-token prefill chunk."""
    gen = torch.Generator().manual_seed(seed)
    probes: dict[tuple[int, int], Linear] = {}
    for lin in sorted(linears, key=lambda lin: lin.shape[0] * lin.shape[1]):
        probes.setdefault(lin.shape, lin)  # small first: a failing candidate fails cheaply
    for cand in MIN_ROWS_CANDIDATES:
        if all(_verdict(lin, cand, gen) for lin in probes.values()):
            return cand
    return None


def _verdict(lin: Linear, min_rows: int, gen: torch.Generator) -> bool:
    w = lin.packed if lin.packed is not None else lin.weight
    assert w is not None
    key = (lin.shape, w.dtype, w.device, lin.is_packed, torch.get_num_threads(), min_rows)
    if key not in _verdicts:
        saved, lin.min_rows = lin.min_rows, min_rows
        try:
            x = torch.randn(_PROBE_FULL, lin.shape[1], generator=gen)
            _verdicts[key] = _invariant(lin, x.to(device=w.device, dtype=w.dtype))
        finally:
            lin.min_rows = saved
    return _verdicts[key]


def _invariant(lin: Linear, x: torch.Tensor) -> bool:
    span = min(48, max(8, -(-_PROBE_ELEMENTS // lin.shape[0])))
    with torch.inference_mode():
        want = lin(x)[:span]
        for m in _PROBE_ROWS:
            got = torch.cat([lin(x[i:i + m]) for i in range(0, span, m)])
            if not torch.equal(got[:span], want):
                return False
    return True
