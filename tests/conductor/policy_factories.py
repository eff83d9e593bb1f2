"""Small factories for hand-built policy snapshots with round-number predictors.

Predictors: prefill = 1 ms per new token; decode step = 10 ms + 10 ms per sequence + 1 µs per
context token; transfer = bytes / bandwidth. With ``kv_bytes_per_token=1000`` and a 10 MB/s link,
fetching a token costs 0.1 ms, a tenth of recomputing it.
"""

from __future__ import annotations

from yuebing.conductor.policy import (
    BivariatePolynomial,
    ClusterView,
    DecodePredictor,
    DecodeState,
    PolicyConfig,
    Predictors,
    PrefillPredictor,
    PrefillState,
    RequestInfo,
    TransferPredictor,
)
from yuebing.core.ids import BlockHash, InstanceId

PREDICTORS = Predictors(
    PrefillPredictor(BivariatePolynomial(((1, 0),), (0.001,))),
    DecodePredictor(BivariatePolynomial(((0, 0), (1, 0), (0, 1)), (0.01, 0.01, 1e-6))),
    TransferPredictor(overhead_s=0.0, efficiency=1.0),
    source="test",
)


def config(**kw: object) -> PolicyConfig:
    base: dict[str, object] = dict(block_tokens=100, kv_bytes_per_token=1000,
                                   decode_durations_s=(10.0,))
    base.update(kw)
    return PolicyConfig(**base)  # type: ignore[arg-type]


def request(input_tokens: int = 1000, output: int = 100, rid: str = "r1") -> RequestInfo:
    nkeys = -(-input_tokens // 100)
    return RequestInfo(rid, 0.0, input_tokens, tuple(BlockHash(k) for k in range(nkeys)), output)


def prefill(name: str, queue_s: float = 0.0, local: int = 0, queued: int = 0) -> PrefillState:
    return PrefillState(InstanceId(name), queue_s, queued, local)


def decode(name: str, batch: int = 0, ctx: int = 0, kv: int | None = None,
           cap: int = 1_000_000) -> DecodeState:
    return DecodeState(InstanceId(name), batch, ctx, ctx if kv is None else kv, cap)


def view(prefills: tuple[PrefillState, ...] = (), decodes: tuple[DecodeState, ...] | None = None,
         **kw: object) -> ClusterView:
    if decodes is None:
        decodes = (decode("d0"),)
    return ClusterView(now_s=kw.pop("now_s", 100.0), prefills=prefills,  # type: ignore[arg-type]
                       decodes=decodes, link_bandwidth_Bps=kw.pop("bw", 1e7),  # type: ignore[arg-type]
                       **kw)  # type: ignore[arg-type]
