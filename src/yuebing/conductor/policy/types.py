"""Inputs and outputs of the pure Conductor policies, frozen and free of I/O.

The simulator and the live Conductor each build a `RequestInfo` and a `ClusterView` per
arriving request (filling in the per-request facts they own: which instance holds how many of
its leading blocks; ``now_s`` comes in the view, never from a clock) and call
``Policy.decide``. It returns a `Route` (prefill and decode instance, the prefix to reuse and
from where, the estimates) or a `Reject` (why, at which stage, when to retry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from yuebing.core.ids import BlockHash, InstanceId


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One request as the Conductor sees it at arrival."""

    request_id: str
    arrival_s: float
    input_tokens: int
    block_keys: tuple[BlockHash, ...]
    """Chained keys of the prompt's full blocks (trace ``hash_ids`` or `hash_blocks`)."""
    expected_output_tokens: int
    """Trace output length in the simulator; ``max_tokens`` (or a predictor) live."""


@dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """A request waiting for a prefill instance, as the queue orders see it."""

    request_id: str
    arrival_s: float
    prefill_s: float
    """Estimated seconds the instance spends on it (prefix fetch + prefill)."""
    deadline_s: float
    """When its first token is due (arrival + TTFT SLO)."""


@dataclass(frozen=True, slots=True)
class PrefillState:
    """Snapshot of one prefill instance, specialised to the request being routed."""

    instance_id: InstanceId
    queue_s: float
    """Predicted seconds until this instance could start a new request (work queued ahead)."""
    queued_requests: int
    local_prefix_blocks: int
    """Leading blocks of this request already in this instance's own cache (DRAM/HBM)."""
    node: str = ""
    """Host the instance runs on (transfers between instances of one node are cheaper)."""
    waiting: tuple[QueuedPrefill, ...] = ()
    """The requests of ``queue_s`` not started yet, in queueing order: the queue order
    (`yuebing.conductor.policy.queue`) may serve a new request before some of them."""
    time_factor: float = 1.0
    """A prefill here takes this share of the predictor's time now (< 1 while it would run
    on cores its idle host-mates lend it)."""
    local_extra_tokens: int = 0
    """Prompt tokens past ``local_prefix_blocks`` that this instance's engine holds too (its
    prefix cache keeps pages finer than a block; the live Conductor's `conductor.pages`, 0 in
    the simulator, whose engines cache whole blocks)."""


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """A declared chunked pipeline parallel group: prefill instances that each hold a range of
    the layers (``stages`` in layer order). It is in the view only while every stage is; its
    prefill starts when every stage's queue is through."""

    group_id: InstanceId
    stages: tuple[PrefillState, ...]
    twins: tuple[PrefillState, ...] = ()
    """Its whole-model twins (``--twin-of``, each on a stage's machine, also in
    ``ClusterView.prefills``): their work delays the group's start, and they are offered short
    prompts only while the group is `idle`."""

    @property
    def queue_s(self) -> float:
        """When its slowest machine is through: its stages' queues and its twins'."""
        return max(s.queue_s for s in (*self.stages, *self.twins))

    @property
    def idle(self) -> bool:
        """No group request is queued or running on it."""
        return all(s.queue_s <= 0 and s.queued_requests == 0 for s in self.stages)

    @property
    def local_prefix_blocks(self) -> int:
        """Leading blocks every stage holds for its own layers."""
        return min(s.local_prefix_blocks for s in self.stages)


@dataclass(frozen=True, slots=True)
class DecodeState:
    """Snapshot of one decode instance."""

    instance_id: InstanceId
    batch_size: int
    context_tokens: int
    """Sum of the context lengths of the running batch."""
    kv_used_tokens: int
    kv_capacity_tokens: int
    waiting_requests: int = 0
    """Requests whose KV arrived or is arriving but that are not yet in the batch."""
    waiting_context_tokens: int = 0
    """Sum of the context lengths of those waiting requests."""


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """Where the longest cached prefix of this request lives in the global pool."""

    holder: InstanceId | str
    """Instance (or store node) holding ``blocks`` leading blocks of the request."""
    blocks: int
    node: str = ""


@dataclass(frozen=True, slots=True)
class PendingDecode:
    """A request already routed that has not reached decode yet (for load forecasting)."""

    expected_decode_start_s: float
    expected_output_tokens: int
    decode_id: InstanceId | None = None
    """Decode instance it was routed to; None spreads it evenly over all decode instances."""
    context_tokens: int = 0
    """Its prompt length (KV it will bring to decode)."""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Everything a policy may look at for one decision."""

    now_s: float
    prefills: tuple[PrefillState, ...]
    decodes: tuple[DecodeState, ...]
    best_prefix: PrefixSource | None = None
    """Longest prefix of this request anywhere in the global KV index (None: nothing cached)."""
    link_bandwidth_Bps: float = 100e9
    """Bandwidth of one inter-node KV transfer, bytes/s."""
    link_latency_s: float = 0.0
    pending_decodes: tuple[PendingDecode, ...] = field(default=())
    """Routed requests still in prefill/transfer (predictive early rejection uses these)."""
    groups: tuple[PrefillGroup, ...] = field(default=())
    """Declared pipeline groups (live: stage instances, ``--layers``). With none, a long
    prefill's estimate assumes a group formed from any prefill instances (the simulator's
    default)."""


class RejectStage(IntEnum):
    """Where in a request's life the rejection happened (ordered by time)."""

    ARRIVAL = 0
    PREFILL = 1
    DECODE = 2


@dataclass(frozen=True, slots=True)
class Route:
    """Decision to serve a request: the adapter queues it on ``prefill_id`` then ``decode_id``."""

    prefill_id: InstanceId
    decode_id: InstanceId
    reused_blocks: int
    """Leading blocks whose KV is reused (local or fetched) instead of recomputed."""
    fetch_from: InstanceId | str | None
    """Holder to copy the prefix from before prefill; None when the local prefix is used."""
    fetch_blocks: int
    """Blocks to copy from ``fetch_from``: those after the instance's local prefix, up to
    ``reused_blocks`` (copying them also replicates hot blocks, paper §4.2)."""
    est_transfer_s: float
    est_queue_s: float
    est_prefill_s: float
    est_ttft_s: float
    est_tbt_s: float
    """Predicted paper TBT (the mean step with its tail, `Policy.tbt`)."""
    est_step_s: float = 0.0
    """Predicted mean decode step on joining (before the tail)."""
    prefill_busy: bool = False
    """A prefill instance had work when it was routed: its TBT was predicted with the tail."""
    prefill_factor: float = 1.0
    """The prefill instance's `PrefillState.time_factor` in ``est_prefill_s`` (1 for a group)."""
    stages: tuple[InstanceId, ...] = ()
    """A route to a pipeline group (``prefill_id`` is its ``group_id``): its stages in layer
    order; empty for a single prefill instance."""


@dataclass(frozen=True, slots=True)
class Reject:
    """Decision to refuse a request now; the gateway answers 429 with ``Retry-After``."""

    reason: str
    """A `yuebing.conductor.policy.RejectReason` value (adapters may add their own strings)."""
    stage: RejectStage
    retry_after_s: float
    """Seconds after which the request would likely be accepted; ``math.inf`` when it can
    never be served by this cluster (e.g. its KV exceeds every decode instance)."""
    est_ttft_s: float | None = None
    est_tbt_s: float | None = None


Decision = Route | Reject


class RejectReason(StrEnum):
    """Why a request was rejected (the ``reason`` of a `Reject`)."""

    NO_INSTANCES = "no_instances"
    UNSERVABLE = "unservable"
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"
    KV_CAPACITY = "kv_capacity"
    PREFILL_OVERLOAD = "prefill_overload"
    DECODE_OVERLOAD = "decode_overload"
    RUNNING_TBT = "running_tbt"
    """Its prefill, beside the running decodes, would push their TBT over the SLO."""


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The chosen prefill instance and the TTFT estimate with its parts."""

    index: int
    """Position of the instance in ``view.prefills``."""
    reused_blocks: int
    fetch_blocks: int
    """Blocks copied from ``view.best_prefix.holder`` first (0: local prefix only)."""
    transfer_s: float
    queue_s: float
    prefill_s: float
    group: int = -1
    """Position of the chosen pipeline group in ``view.groups`` (-1: ``index``'s instance)."""

    @property
    def ttft_s(self) -> float:
        return self.transfer_s + self.queue_s + self.prefill_s


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """The chosen decode instance with its predicted TBT and load for this request."""

    index: int
    tbt_s: float
    """Predicted paper TBT (`Policy.tbt`)."""
    kv_fits: bool
    load: float
    step_s: float
    """Predicted mean step, before the tail (what `TbtTail` compares the paper TBT with)."""
