"""The simulator's bridge to the shared Conductor policy: predictors and policy config.

A simulated system calls `policy_for` once before the run. The predictors are fitted from
samples of the run's cost model (as ``yuebing profile`` does against the engine; cached per cost
model). The forecast's decode durations are `SimConfig.forecast_durations_s` where given (what
a live Conductor learns), else 100 quantiles of the workload's output lengths times the step of
a loaded decode node (capped by the TBT SLO), since the forecast matters when decode is
loaded. The policy gets the simulator's CPP settings, so its long-prompt TTFT
estimate is the pipelined one the simulator runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from weakref import WeakKeyDictionary

import numpy as np

from yuebing.conductor.policy import (
    DecodePredictor,
    Policy,
    PolicyConfig,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
)
from yuebing.conductor.policy.decode import duration_quantiles
from yuebing.sim.hardware import CostModel
from yuebing.sim.system import SimConfig
from yuebing.sim.workload import SimRequest

DECODE_DEGREE = 3
"""Degree of the decode step-time polynomial: the roofline's step is the maximum of a memory
and a compute term and switches between them inside the operating range (short contexts at
large batches), which a plane misses by 5-8 % near a full node; degree 3 stays within 2 %."""
DURATION_QUANTILES = 100
"""How many equally likely values stand for the decode-duration distribution. The forecast
weighs a request decoding now by its residual life E[max(0, D - Δ)] / E[D], where Δ is a TTFT
(up to the 30 s SLO) and so often longer than most decodes: only the distribution's tail
counts there. Ten deciles (5 %…95 %) drop the tail beyond the 95th percentile and put the
residual life at 25 s 27 % low on the arXiv-like workload; 100 values are within 3 %."""
_FITS: WeakKeyDictionary[CostModel, Predictors] = WeakKeyDictionary()


def predictors_for(cost: CostModel) -> Predictors:
    """Predictors fitted to ``cost`` (prefill over 0..128k new/cached tokens, decode over
    batches up to 256 and contexts up to the decode KV capacity, degree `DECODE_DEGREE`)."""
    cached = _FITS.get(cost)
    if cached is not None:
        return cached
    pred = Predictors(
        prefill=PrefillPredictor.from_function(cost.prefill_time),
        decode=DecodePredictor.from_function(
            cost.decode_step_time, max_context_tokens=cost.decode_kv_capacity_tokens,
            degree=DECODE_DEGREE),
        transfer=TransferPredictor(),
        source=f"simulator cost model {type(cost).__name__}",
    )
    _FITS[cost] = pred
    return pred


def decode_durations(cost: CostModel, requests: Sequence[SimRequest],
                     tbt_slo_s: float = math.inf) -> tuple[float, ...]:
    """`DURATION_QUANTILES` equally likely decode durations (s) for the predictive early
    rejection forecast: the output lengths' quantiles at the midpoints of equal-probability
    bins × the step time of a full decode node, at most ``tbt_slo_s``."""
    outputs = np.array([r.output_tokens for r in requests], dtype=float)
    mean_ctx = float(np.mean([r.input_tokens + r.output_tokens / 2 for r in requests]))
    full = cost.decode_kv_capacity_tokens
    batch = max(1, math.floor(full / mean_ctx))
    step = min(cost.decode_step_time(batch, full), tbt_slo_s)
    return duration_quantiles([float(o) * step for o in outputs], DURATION_QUANTILES)


def policy_config(config: SimConfig, cost: CostModel,
                  requests: Sequence[SimRequest]) -> PolicyConfig:
    """The `PolicyConfig` a simulation run uses."""
    return dataclasses.replace(
        config.policy,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        decode_durations_s=(config.forecast_durations_s
                            or decode_durations(cost, requests, config.policy.tbt_slo_s)),
        cpp_chunk_tokens=cost.prefill_chunk_tokens,
    )


def policy_for(config: SimConfig, cost: CostModel, requests: Sequence[SimRequest]) -> Policy:
    """The shared Conductor `Policy` for this run."""
    return Policy(policy_config(config, cost, requests), predictors_for(cost))
