"""Control-plane messages between the Conductor and serving instances (prefill/decode/coupled).

One zmq ROUTER per instance, one DEALER per Conductor; every frame is one `encode`d message.
Requests carry ``seq``; the instance answers each with the reply or an `ErrorReply` echoing it.
After `Subscribe` the instance pushes `LoadReport`s and the `TaskEvent`s of the tasks that
connection submitted (one engine step's as one `TaskEvents` frame). KV bytes never travel here:
a prefill writes them through the transfer engine and tells its decode with a `KvReady`
notification. A disaggregated request: `Reserve` (decode) → `SubmitTask(PREFILL)` → events of
both; docs/instances.md tells it step by step. Used by `yuebing.instance` and the Conductor.
"""

from __future__ import annotations

from enum import IntEnum

from yuebing.protocol.codec import Message, register_message


class Role(IntEnum):
    PREFILL = 0
    DECODE = 1
    COUPLED = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class TaskMode(IntEnum):
    """What an instance does with a submitted task."""

    PREFILL = 0
    """Prefill only: first token, KV streamed to ``decode``, new blocks saved."""
    COUPLED = 1
    """Prefill and decode here (the baseline; also a decode-less fallback)."""


class ErrorCode(IntEnum):
    BAD_REQUEST = 1
    """Malformed or invalid message; nothing changed."""
    NO_KV = 2
    """Not enough free KV blocks now (retry later or elsewhere)."""
    UNKNOWN_TASK = 3
    DUPLICATE = 4
    """A task or reservation with that request id exists."""
    OVERLOADED = 5
    INTERNAL = 6
    TRANSFER = 7
    """KV could not be moved to / from a peer."""
    CANCELLED = 8
    SHUTTING_DOWN = 9
    PREFIX_MISSING = 10
    """A pipeline stage lacks the planned prefix (its range's store objects were evicted after
    the Conductor looked): the Conductor re-dispatches the request, recomputing the prefix."""


class EventKind(IntEnum):
    """Ordered phases of a task's event stream."""

    FIRST_TOKEN = 0
    TOKENS = 1
    FINISH = 2
    ERROR = 3


MAX_LOGPROBS = 20
"""Most top logprobs per token an instance computes (= `yuebing.engine.sampling`'s)."""
MAX_N = 64
"""Most choices per request an instance samples (= `yuebing.engine.sampling`'s)."""


class Sampling(Message, tag="inst.sampling"):
    """Sampling parameters as sent on the wire (validated again by the engine)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    """Choices sampled from one prefill (choice ``j`` seeded with ``seed + j``)."""
    logprobs: int | None = None
    """Per token: the chosen token's logprob and this many top alternatives (None: none)."""


class PrefixPlan(Message, tag="inst.prefix_plan"):
    """Which leading tokens of the prompt to reuse instead of computing, and from where.

    ``source`` is ``"local"`` (this instance's own prefix cache), ``"store"`` (the KV pool) or
    ``"peer"`` (another instance's cache, named by ``peer``; Algorithm 1's transfer, which
    also replicates hot blocks here). Loading fewer tokens than planned (evicted meanwhile, a
    fingerprint mismatch) is never an error: the rest is computed.
    """

    tokens: int = 0
    source: str = "local"
    peer: str = ""
    peer_address: str = ""
    layer_ranges: list[str] = []
    """``store``: the prefix may also be stored as these layer ranges' objects (``A:B``, the
    stages of a pipeline group, tiling the model): a whole-model instance assembles them."""


class KvLayout(Message, tag="inst.kv_layout"):
    """Geometry of a KV pool laid out ``[layers, 2, num_blocks, kv_heads, block_size, hd]``.

    A prefill writes layer ``l``, K/V ``k``, block ``b`` at byte offset
    ``((l * 2 + k) * num_blocks + b) * chunk_bytes`` of the segment.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    chunk_bytes: int
    fingerprint: str
    """KV fingerprint: prefill and decode must compute identical KV bytes."""


class DecodeTarget(Message, tag="inst.decode_target"):
    """Where a prefill writes the KV: the decode's reserved blocks (from `Reserved`). A vLLM
    decode (fingerprint ``vllm-...``) reserves blocks of its receive pool instead, laid out
    ``[layers, num_blocks, block]`` with K|V inside the block: layer ``l``, block ``b`` at
    ``(l * num_blocks + b) * chunk_bytes`` (`integrations.vllm.stream.RecvPool`); no blocks:
    no layer-wise hand-off (through the store)."""

    instance_id: str
    segment: str
    """Transfer-engine segment of the decode's KV pool."""
    blocks: list[int]
    layout: KvLayout
    expires_at_s: float = 0.0
    """Wall-clock time (time.time()) the reservation expires; the prefill stops writing
    into it ``EXPIRY_MARGIN_S`` before (0: no expiry)."""


class StagePlan(Message, tag="inst.stage_plan"):
    """A PREFILL task's place in a chunked pipeline parallel group (issue 27): every stage of
    the group gets the same task with its own ``index``; stage ``index`` sends its boundary
    rows to ``next_segment`` (the next stage's `Hello.stage_segment`; '' on the last stage),
    and every stage streams its own layers' KV into ``decode``'s reserved blocks."""

    index: int
    count: int
    next_segment: str = ""
    prefix_tokens: int = 0
    """Prompt tokens every stage reuses from its own prefix cache (whole engine blocks)."""


class EngineProfile(Message, tag="inst.engine_profile"):
    """An instance's start-up profile of its own engine (``instance/startup_profile.py``): the
    Conductor fits its prefill / decode predictors to it. ``configuration`` is the engine's
    signature (weights, dtype, threads, attention paths, invariance, machine, ...)."""

    configuration: dict[str, str]
    prefill: list[tuple[int, int, float]] = []
    """(new tokens, cached tokens, seconds to the first token)."""
    decode: list[tuple[int, int, float]] = []
    """(batch size, context tokens in all, seconds per step)."""
    lent_threads: int = 0
    """With ``--lend-cores``: the threads a prefill step runs with while the host's other
    instances are idle (0: it never borrows); ``prefill_lent`` was timed with them."""
    prefill_lent: list[tuple[int, int, float]] = []
    """(new tokens, cached tokens, seconds) at ``lent_threads``: points of ``prefill``
    timed again, which give the Conductor the prefill's speed on borrowed cores."""


# --------------------------------------------------------------- Conductor -> instance


@register_message
class Subscribe(Message, tag="inst.subscribe"):
    """Start pushing `LoadReport`s to this connection (answered with `Hello`)."""

    seq: int
    conductor: str = ""


@register_message
class SubmitTask(Message, tag="inst.submit"):
    seq: int
    request_id: str
    token_ids: list[int]
    sampling: Sampling
    mode: TaskMode = TaskMode.COUPLED
    prefix: PrefixPlan | None = None
    decode: DecodeTarget | None = None
    stage: StagePlan | None = None
    """On a stage instance (``--layers``): its part of a pipeline group's prefill."""


@register_message
class Reserve(Message, tag="inst.reserve"):
    """Decode side: hold blocks for ``prompt_tokens`` tokens of a request before its prefill."""

    seq: int
    request_id: str
    prompt_tokens: int
    sampling: Sampling
    token_ids: list[int] = []
    """The prompt (the decode instance needs it for detokenizing and stop strings)."""
    timeout_s: float = 120.0
    """The reservation is dropped if no KV arrives within this time (the Conductor sets it
    from the request's TTFT estimate; a long prompt on a busy prefill takes a while)."""


@register_message
class Cancel(Message, tag="inst.cancel"):
    seq: int
    request_id: str


@register_message
class Ping(Message, tag="inst.ping"):
    seq: int


@register_message
class FetchPrefix(Message, tag="inst.fetch_prefix"):
    """Instance → peer instance: write the KV of the longest cached prefix of ``token_ids``
    (at most ``max_tokens`` tokens, whole engine blocks) into ``segment`` at ``offset`` as
    contiguous blocks ``[n, layers, 2, kv_heads, bs, hd]``; answered with `Fetched`."""

    seq: int
    token_ids: list[int]
    max_tokens: int
    segment: str
    offset: int
    capacity_bytes: int
    fingerprint: str
    deadline_s: float = 0.0
    """Wall-clock time after which the holder must not write (the asker reuses the range
    after it); 0: the holder's transfer timeout."""


# --------------------------------------------------------------- instance -> Conductor


@register_message
class Hello(Message, tag="inst.hello"):
    """Who this instance is (answer to `Subscribe`, and in etcd for discovery)."""

    seq: int
    instance_id: str
    role: Role
    model: str
    fingerprint: str
    """Its KV fingerprint (a pipeline stage's: the whole model's; ``layers`` names its part)."""
    host: str
    control_address: str
    kv_segment: str
    block_size: int
    store_block_tokens: int
    num_blocks: int
    max_model_len: int
    incarnation: str
    """Changes on every start: a Conductor seeing a new one forgets the old one's tasks."""
    engine: dict[str, str] = {}
    """The engine configuration it runs (`LLMEngine.signature`); the Conductor refuses an
    instance whose configuration differs from the one its predictors were profiled for."""
    profile: EngineProfile | None = None
    """Its start-up profile (``--startup-profile``), or None."""
    layers: str = ""
    """A stage of a pipeline group: the layers ``A:B`` it runs ('' = the whole model)."""
    num_layers: int = 0
    """The model's layer count (0: not said)."""
    stage_segment: str = ""
    """A stage's transfer segment: the previous stage notifies its boundary rows there."""
    group: str = ""
    """A stage's pipeline group (``--cpp-group``): the Conductor's group of stages of one name."""
    twin_of: str = ""
    """A whole-model twin (``--twin-of A:B``): it shares the machine, and the Conductor's gate,
    of stage ``A:B`` of ``group``, and prefills short prompts while the group is idle."""
    prefix_caching: bool = True
    """Its engine reuses cached KV pages of earlier prompts (`conductor.pages` counts them)."""


@register_message
class Ack(Message, tag="inst.ack"):
    seq: int


@register_message
class Reserved(Message, tag="inst.reserved"):
    seq: int
    target: DecodeTarget


@register_message
class Fetched(Message, tag="inst.fetched"):
    seq: int
    blocks: int
    """Whole engine blocks written (0: nothing cached)."""


@register_message
class ErrorReply(Message, tag="inst.error"):
    seq: int
    code: ErrorCode
    message: str


@register_message
class Breakdown(Message, tag="inst.breakdown"):
    """Where a task's time went, seconds (filled by the instance that did the work)."""

    queue_s: float = 0.0
    prefix_load_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    """From the end of the prefill's last layer to the KV being complete at the decode."""
    decode_wait_s: float = 0.0
    """From the KV being complete to the first decode step."""
    kv_bytes: int = 0
    """KV bytes streamed to the decode (prefill)."""
    streamed_layers: int = 0
    layers_before_prefill_end: int = 0
    """Layers whose KV had fully reached the decode before the prefill's last layer was
    computed (layer-wise streaming at work: ideally all but the last)."""
    prefill_tokens: int = 0
    """Prompt tokens the instance that prefilled computed for the request (its forward
    passes, all choices together: n choices share one prefill)."""
    prefill_threads: float = 0.0
    """The mean threads of the engine's steps from its first prefill chunk to its first
    token, weighted by their time (cores lent: more than the instance's own; 0: unknown)."""


@register_message
class TaskEvent(Message, tag="inst.event"):
    """Progress of one task. ``time_s`` is the instance's wall clock (time.time())."""

    request_id: str
    kind: EventKind
    token_ids: list[int] = []
    token_times: list[float] = []
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error_code: ErrorCode | None = None
    error: str = ""
    breakdown: Breakdown | None = None
    time_s: float = 0.0
    index: int = 0
    """The choice (0..n-1) the tokens and ``finish_reason`` belong to. A choice that ends
    before the request sets ``finish_reason`` on a TOKENS event; FINISH ends the request."""
    logprobs: list[float] = []
    """Per token of ``token_ids`` (when asked): its logprob (raw float32 log-softmax)."""
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    """Per token: the most likely tokens and their logprobs, best first."""


@register_message
class TaskEvents(Message, tag="inst.events"):
    """Several `TaskEvent`s for one connection in one frame: what one engine step produced
    for that Conductor's tasks (a decode batch of N requests sends one frame, not N)."""

    events: list[TaskEvent]


@register_message
class LoadReport(Message, tag="inst.load"):
    """Load and cache changes, pushed at ``report_hz`` and on change."""

    instance_id: str
    incarnation: str
    report_seq: int
    time_s: float
    queued_prefill_tokens: int
    queued_requests: int
    running: int
    waiting: int
    context_tokens: int
    free_blocks: int
    total_blocks: int
    reserved_blocks: int
    prefill_tokens_per_s: float
    decode_step_s: float
    preemptions: int = 0
    """Requests preempted (KV short mid-decode) and recomputed since start."""
    step_threads: int = 0
    """The threads a step begun now would run with: its own plus the host's idle cores
    (``--lend-cores``; 0: it never borrows)."""
    cache_added: list[int] = []
    """Store-block keys now in this instance's local prefix cache."""
    cache_removed: list[int] = []
    cache_full_resync: bool = False
    """``cache_added`` is the whole cache (first report or after a gap): replace, not merge."""


@register_message
class KvReady(Message, tag="inst.kv_ready"):
    """Prefill → decode (transfer notification): the KV of ``num_tokens`` tokens is in the
    reserved blocks; decoding continues from ``first_token``."""

    request_id: str
    num_tokens: int
    first_token: int
    first_token_time_s: float
    prefill_end_s: float
    cached_tokens: int = 0
    ok: bool = True
    error: str = ""
    first_tokens: list[int] = []
    """With n > 1: each choice's first token (``first_token`` is choice 0's)."""


@register_message
class KvStreamed(Message, tag="inst.kv_streamed"):
    """vLLM prefill worker → decode (transfer notification): the prompt's KV of every layer
    was written layer by layer into the decode's receive pool (`integrations.vllm.stream`).
    Times are the prefill's wall clock (time.time())."""

    request_id: str
    ok: bool
    layers: int
    layers_before_last: int
    """Layers whose KV had fully reached the decode before the last layer was computed."""
    bytes: int
    last_layer_at_s: float
    complete_at_s: float
    error: str = ""


ControlRequest = Subscribe | SubmitTask | Reserve | Cancel | Ping | FetchPrefix
ControlReply = Hello | Ack | Reserved | Fetched | ErrorReply
