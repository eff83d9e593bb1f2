"""The inference engine: `LLMEngine`, one model, one paged KV pool, a continuous batch.

`add_request` validates and tokenizes the prompt and queues a `Sequence`; every `step` asks the
scheduler for a plan (decode tokens plus prefill chunks under the token budget), runs one
forward pass, samples for each sequence that reached the end of its tokens, applies stop
conditions and returns a `RequestOutput` per sequence that produced something. A request with
``n > 1`` forks where its prefill samples (`_forks`, `_fork`); `abort` ends one at any time.
Prefill and decode instances (`yuebing.instance`) wrap an engine: they stream KV layer by
layer through `add_layer_hook` and install or adopt KV with `yuebing.engine.kv_transfer`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from yuebing.core.errors import ConfigError, InputError, PrefixMissing
from yuebing.core.hashing import hash_blocks
from yuebing.core.ids import BlockHash
from yuebing.engine import (
    amx_linear,
    blas_attention,  # noqa: F401  (registers the "blas" prefill path)
    fused_decode,
    native,
    runtime,
)
from yuebing.engine.attention import (
    DECODE_IMPLS,
    PREFILL_IMPLS,
    TOKEN_IMPLS,
    choose_attention,
    decode_supported,
    prefill_supported,
)
from yuebing.engine.block_manager import BlockAllocator
from yuebing.engine.choices import attention_choice, routes_choice, rows_choice, shared_choice
from yuebing.engine.config import EngineConfig, parse_layers
from yuebing.engine.kernels import NATIVE_ATTENTION, resolve_kernels
from yuebing.engine.kv_cache import KVPool
from yuebing.engine.linear import (
    ROUTE_CONSISTENCY,
    ROUTE_MARGIN,
    ROUTE_POINTS,
    ROUTE_ROUNDS,
    ROUTE_WEIGHTS,
    amx_key,
    choose_amx,
    choose_routes,
    shape_key,
)
from yuebing.engine.model import Boundary, LayerHook, LlamaModel
from yuebing.engine.runner import ModelRunner
from yuebing.engine.sampling import SamplingParams, TokenLogprobs, make_generator, sample
from yuebing.engine.scheduler import Scheduler, StepPlan
from yuebing.engine.sequence import FinishReason, Phase, RequestOutput, Sequence, StageInput
from yuebing.engine.tokenizer import IncrementalDetokenizer, tokenizer_from_source
from yuebing.engine.weights import LoadedWeights, load_weights

log = logging.getLogger(__name__)


def kv_fingerprint(weights_fingerprint: str, dtype: torch.dtype,
                   block_shape: tuple[int, ...], batch_invariant: bool = False,
                   layers: tuple[int, int] | None = None) -> str:
    """``model:digest`` of everything that makes KV bytes differ between two engines
    (batch-invariant engines share KV only with each other: their attention's bits differ;
    a pipeline stage's blocks hold only its ``layers``)."""
    name = weights_fingerprint.split(":", 1)[0]
    what: tuple[object, ...] = (weights_fingerprint, str(dtype), block_shape)
    if batch_invariant:
        what += ("batch-invariant",)
    if layers is not None:
        what += ("layers", layers)
    digest = hashlib.blake2b(repr(what).encode(), digest_size=8).hexdigest()
    return f"{name}:{digest}"


class LLMEngine:
    """Continuous-batching LLaMA-family engine over a paged KV cache."""

    def __init__(self, config: EngineConfig, weights: LoadedWeights | None = None,
                 kv_storage: Callable[[int], torch.Tensor] | None = None) -> None:
        """``kv_storage(nbytes)``, when given, returns the flat uint8 memory for the KV pool
        (an instance passes a registered shared-memory segment so peers write KV into it)."""
        self.config = config
        self.device, self.dtype = runtime.setup(config)
        w = weights if weights is not None else load_weights(config.model, config.weights_seed)
        self.model_config = mc = w.config
        self.weights_fingerprint = w.fingerprint
        self.tokenizer = tokenizer_from_source(w.tokenizer_source)
        self.eos_token_ids = frozenset(w.eos_token_ids)
        self.layers = parse_layers(config.layers, mc.num_layers)
        """The layers this engine runs, [A, B): every layer, or a pipeline stage's."""
        self.staged = self.layers != (0, mc.num_layers)
        """A stage of a chunked pipeline parallel prefill: its requests are only prefilled
        (`feed` gives a later stage its input; the last stage samples one token)."""
        self.model = LlamaModel(mc, w.tensors, self.dtype, self.device,
                                config.packed_weights, self.layers)
        kv_cfg = replace(mc, num_layers=self.layers[1] - self.layers[0])
        if config.max_model_len > mc.max_position:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the context of "
                              f"model {mc.name} ({mc.max_position} tokens); give at most "
                              f"{mc.max_position}, or 0 for the model's own")
        self.max_model_len = config.max_model_len or mc.max_position
        bs = config.block_size
        nb = config.num_blocks or max(
            1, config.kv_cache_bytes // KVPool.bytes_per_block(kv_cfg, bs, self.dtype))
        storage = None if kv_storage is None else \
            kv_storage(nb * KVPool.bytes_per_block(kv_cfg, bs, self.dtype))
        self.pool = KVPool(kv_cfg, nb, bs, self.dtype, self.device, storage)
        self.fingerprint = kv_fingerprint(w.fingerprint, self.dtype, self.pool.block_shape,
                                          config.batch_invariant,
                                          self.layers if self.staged else None)
        """Names the KV bytes this engine computes: weights' content, dtype, block geometry.
        KV is exchanged (store, peers) only between engines with equal fingerprints."""
        self.model_fingerprint = self.fingerprint if not self.staged else kv_fingerprint(
            w.fingerprint, self.dtype, (mc.num_layers, *self.pool.block_shape[1:]),
            config.batch_invariant)
        """The fingerprint of the whole model's KV (= `fingerprint` unless a pipeline stage):
        a stage streams its layers into a decode whose pool has this one."""
        # a sequence must fit the pool alone, else preempting it could never make room
        self._too_long_hint = "shorten the prompt"
        if nb * bs < self.max_model_len:
            self.max_model_len = nb * bs
            self._too_long_hint = (f"the KV pool of {nb} blocks of {bs} tokens bounds it; raise "
                                   "num_blocks / kv_cache_bytes or shorten the prompt")
        self.allocator = BlockAllocator(nb, config.prefix_caching)
        self.key_extra: tuple[object, ...] = (self.fingerprint,)
        self.scheduler = Scheduler(self.allocator, bs, config.max_num_seqs,
                                   config.max_batch_tokens, config.mixed_batches, self.key_extra,
                                   config.mixed_step_s if self.device.type == "cpu" else 0.0)
        self.kernels = resolve_kernels(config.kernels, self.device, self.dtype)
        self.model.ops = self.kernels
        self.matmul_min_rows: int | None = 1
        """Matmul inputs are padded to this many rows (None: invariance not reached)."""
        self.decode_fused = "off"
        """Fused small-batch decode (`yuebing.engine.fused_decode`): ``b<=N`` or off."""
        self.fused_timings: dict[str, float] = {}
        self.matmul_routes = ""
        """Projection shapes and row counts run by ``torch.mm`` on the row-major weight instead
        of the packed one (`linear.choose_routes`; ``""``: none)."""
        self.route_timings: dict[str, float] = {}
        self.amx_routes = ""
        """Projections and row counts run by the native AMX linear (`linear.choose_amx`;
        ``""``: none)."""
        self.amx_timings: dict[str, float] = {}
        if config.batch_invariant:
            if config.fused_decode > 0:
                raise ConfigError("fused_decode cannot be used with batch_invariant: its sums "
                                  "are ordered unlike the prefill's matmuls; use 0 or -1")
            self._use_token_attention(config)
        else:
            self._choose_attention(config)
            self._choose_fused_decode(config.fused_decode)
            self._choose_routes()
            self._choose_amx()
        self.model.use_fused(self.model.fused)
        self.runner = ModelRunner(self.model, self.pool, per_token=config.batch_invariant)
        self._signature = self._describe()
        """`signature`: taken here, in the thread that set the engine's threads up."""
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._held: dict[str, Sequence] = {}
        """Finished ``hold_kv`` requests whose blocks stay allocated until `release`."""
        self._deferred: list[RequestOutput] = []
        """Other requests' outputs produced while `generate` / `stream` ran (next `step`)."""
        self.num_steps = 0
        self.last_plan: StepPlan | None = None
        """The plan of the last completed step (step statistics)."""
        self.current_plan: StepPlan | None = None
        """The plan being executed (set during `step`, read by layer hooks)."""
        self.logits_hook: Callable[[list[str], torch.Tensor], None] | None = None
        """Called each step with the sampled requests' ids and float32 logits (tests, research)."""
        log.info("engine ready: %s, %s layers, %s KV blocks of %s tokens, attention "
                 "decode=%s prefill=%s, kernels %s", mc.name, mc.num_layers, nb, bs,
                 self.attention, self.prefill_attention, self.kernels.name)

    def _use_token_attention(self, config: EngineConfig) -> None:
        """Batch-invariant mode: one attention for every token (`attention.TOKEN_IMPLS`), the
        native paged kernel where the engine runs the native kernels, else the torch loop."""
        name = "paged" if self.kernels.name == "native" and decode_supported(
            "paged", self.dtype, self.device) else "loop"
        if config.attention == "paged" and name != "paged":
            raise ConfigError(f"decode attention 'paged' does not run with {self.dtype} on "
                              f"{self.device.type} with kernels={self.kernels.name}; use auto")
        self.attention_timings: dict[str, float] = {}
        self.attention = self.prefill_attention = f"invariant:{name}"
        self.model.token_impl = TOKEN_IMPLS[name]
        self.matmul_min_rows = self.model.make_matmuls_invariant()

    def _choose_attention(self, config: EngineConfig) -> None:
        """Set the model's decode/prefill attention: as configured, or measured (``auto``)."""
        mc = self.model.cfg
        decode, prefill = config.attention, config.prefill_attention
        if prefill == "same":  # a decode-only path (paged) leaves prefill to measurement
            prefill = decode if decode == "auto" or decode in PREFILL_IMPLS else "auto"
        # the native decode kernel only where the engine runs the native kernels
        native_ok = self.kernels.name == "native"
        decodes = [n for n in DECODE_IMPLS if native_ok or n not in NATIVE_ATTENTION]
        prefills = [n for n in PREFILL_IMPLS if native_ok or n not in NATIVE_ATTENTION]
        if decode != "auto" and not (decode in decodes and
                                     decode_supported(decode, self.dtype, self.device)):
            raise ConfigError(f"decode attention {decode!r} does not run with {self.dtype} on "
                              f"{self.device.type} with kernels={self.kernels.name}; use auto, "
                              "grouped or sdpa (paged needs the native kernels)")
        self.attention_timings = {}
        if "auto" in (decode, prefill):
            parts: dict[str, object] = {
                "dtype": str(self.dtype), "device": str(self.device),
                "shape": [mc.num_kv_heads, mc.num_heads, mc.head_dim],
                "kernels": native.build_key() if native_ok else "", "decodes": decodes,
                "prefills": prefills}
            (best_decode, best_prefill, self.attention_timings), cached = shared_choice(
                parts, lambda: choose_attention(
                    mc.num_kv_heads, mc.num_heads, mc.head_dim, self.dtype, self.device,
                    decode_names=decodes, prefill_names=prefills), attention_choice)
            log.info("attention measured %s: decode %s, prefill %s",
                     "earlier on this machine" if cached else "now", best_decode, best_prefill)
            decode = best_decode if decode == "auto" else decode
            prefill = best_prefill if prefill == "auto" else prefill
        if not (prefill in prefills and prefill_supported(prefill, self.dtype, self.device)):
            raise ConfigError(f"prefill attention {prefill!r} does not run with {self.dtype} on "
                              f"{self.device.type} with kernels={self.kernels.name}; use auto, "
                              "grouped or sdpa (flash needs the native kernels and bf16, "
                              "flash_amx also a CPU with AMX-BF16)")
        self.attention, self.prefill_attention = decode, prefill
        self.model.decode_impl = DECODE_IMPLS[decode]
        self.model.prefill_impl = PREFILL_IMPLS[prefill]

    def _choose_fused_decode(self, rows: int) -> None:
        """``rows`` -1: where the native kernels run bf16 with AVX512-BF16, time the fused
        decode layer against the op-by-op one and keep it up to the largest batch where it
        wins; 0: off; N: up to N rows (ConfigError where it cannot run). Never in
        batch-invariant mode (its sums are ordered unlike the prefill's matmuls)."""
        cand = self.model.fused_candidate() if rows and self.kernels.name == "native" \
            and fused_decode.available() else None
        if cand is None and rows > 0:
            raise ConfigError(f"fused_decode {rows} needs the native kernels built with "
                              f"AVX512-BF16, bf16 weights on CPU without a QKV bias; here: "
                              f"kernels={self.kernels.name}, {self.dtype}, {self.device.type}; "
                              "use -1 or 0")
        if cand is None:
            return
        if rows > cand.limit:
            raise ConfigError(f"fused_decode {rows} exceeds the fused ops' {cand.limit} rows here "
                              f"({'AMX tiles' if cand.tiles else 'AVX512-BF16 dot products'})")
        if rows > 0:
            cand.max_rows, self.model.fused, self.decode_fused = rows, cand, f"b<={rows}"
            return
        mc = self.model.cfg
        scratch = torch.randn(2, cand.limit * 8, mc.num_kv_heads, 16,
                              mc.head_dim).to(self.dtype)
        parts: dict[str, object] = {
            "kind": "fused_decode", "kernels": native.build_key(), "tiles": cand.tiles,
            "shape": [mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads,
                      mc.head_dim, mc.intermediate_size]}
        (rows, self.fused_timings), _ = shared_choice(
            parts, lambda: fused_decode.choose_max_rows(
                cand, self.model.first_layer_ops, (scratch[0], scratch[1]), 16), rows_choice)
        cand.max_rows = rows
        self.model.fused = cand if rows else None
        self.decode_fused = f"b<={rows}" if rows else "off"
        log.info("fused decode: %s (%s)", self.decode_fused,
                 ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in self.fused_timings.items()))

    def _choose_routes(self) -> None:
        """Where the weights are packed, time the packed and the plain matmul per projection
        shape at prefill row counts (once per machine) and route the rows where plain wins."""
        pairs = self.model.plain_matmuls()
        # a step never has more rows than max_batch_tokens: only the points that stand for it
        points = [p for p in ROUTE_POINTS if p <= self.config.max_batch_tokens * math.sqrt(2)]
        if not self.model.packed or not pairs or not points:
            return
        parts: dict[str, object] = {
            "kind": "matmul_routes", "dtype": str(self.dtype), "points": points,
            "routes": ["packed", "mm"], "margin": ROUTE_MARGIN, "weights": ROUTE_WEIGHTS,
            "rounds": ROUTE_ROUNDS, "consistency": ROUTE_CONSISTENCY,
            "shapes": sorted({shape_key(lin) for lin, _ in pairs})}
        (plain, self.route_timings), cached = shared_choice(
            parts, lambda: choose_routes(pairs, points), routes_choice)
        self.matmul_routes = self.model.use_plain_routes(plain)
        log.info("matmul routes measured %s: mm for %s", "earlier on this machine" if cached
                 else "now", self.matmul_routes or "none")

    def _choose_amx(self) -> None:
        """Where the native kernels run the AMX linear (bf16 on a CPU with AMX-BF16), time it
        against each projection's current route at prefill row counts (once per machine) and
        route the rows where it wins (after `_choose_routes`, whose routes it is timed against)."""
        triples = self.model.amx_matmuls()
        points = [p for p in ROUTE_POINTS if p <= self.config.max_batch_tokens * math.sqrt(2)]
        if not self.config.amx_linear or self.kernels.name != "native" \
                or not amx_linear.available() or not triples \
                or not points or self.dtype != torch.bfloat16:
            return
        parts: dict[str, object] = {
            "kind": "amx_linear", "kernels": native.build_key(), "dtype": str(self.dtype),
            "points": points, "matmul_routes": self.matmul_routes, "margin": ROUTE_MARGIN,
            "weights": ROUTE_WEIGHTS, "rounds": ROUTE_ROUNDS, "consistency": ROUTE_CONSISTENCY,
            "shapes": sorted({amx_key(lin, silu) for lin, _, silu in triples})}
        (chosen, self.amx_timings), cached = shared_choice(
            parts, lambda: choose_amx(triples, self.kernels, points), routes_choice)
        self.amx_routes = self.model.use_amx(chosen)
        log.info("AMX linear measured %s: for %s", "earlier on this machine" if cached
                 else "now", self.amx_routes or "none")

    # ------------------------------------------------------------------------ requests

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def block_keys(self, token_ids: Seq[int]) -> list[BlockHash]:
        """Keys of the full blocks of ``token_ids`` as this engine's prefix cache names them."""
        return hash_blocks(list(token_ids), self.block_size, self.key_extra)

    def encode_prompt(self, prompt: str | Seq[int] | list[dict[str, str]],
                      chat: bool = False) -> list[int]:
        """Token ids of a text prompt, chat messages, or ids given directly (validated)."""
        ids: list[int]
        if isinstance(prompt, str) or chat:
            if self.tokenizer is None:
                raise InputError(f"model {self.model_config.name} has no tokenizer; pass "
                                 "token ids instead of text")
            if isinstance(prompt, str) and not chat:
                ids = self.tokenizer.encode(prompt)
            else:
                messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) \
                    else list(prompt)
                ids = self.tokenizer.encode_chat(messages)  # type: ignore[arg-type]
        else:
            ids = list(prompt)  # type: ignore[arg-type]
        if not ids:
            raise InputError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InputError(f"prompt token ids must be integers in 0..{vocab - 1}")
        if len(ids) >= self.max_model_len:
            raise InputError(f"the prompt has {len(ids)} tokens but the context holds "
                             f"{self.max_model_len} (prompt + output); {self._too_long_hint}")
        return ids

    def add_request(self, prompt: str | Seq[int] | list[dict[str, str]],
                    params: SamplingParams | None = None, request_id: str | None = None,
                    chat: bool = False, hold_kv: bool = False,
                    prefix_tokens: int | None = None) -> str:
        """Queue a request; returns its id. Bad input raises `InputError` and queues nothing.

        ``hold_kv``: when the request finishes its blocks stay allocated (readable with
        `held_sequence`, e.g. to stream or save them) until `release` or `abort`.
        ``prefix_tokens`` (pipeline stages): reuse exactly this many cached prompt tokens, the
        prefix every stage of the group holds (a whole number of blocks)."""
        params = params if params is not None else SamplingParams()
        ids = self.encode_prompt(prompt, chat)
        if prefix_tokens is not None:
            if not self.staged:
                raise InputError("prefix_tokens is for pipeline stages (engine layers A:B)")
            if prefix_tokens < 0 or prefix_tokens % self.block_size or prefix_tokens >= len(ids):
                raise InputError(f"prefix_tokens {prefix_tokens} must be a multiple of the "
                                 f"block size {self.block_size} below the prompt's {len(ids)}")
            have = self.scheduler.cached_tokens(ids, prefix_tokens)
            if have < prefix_tokens:
                raise PrefixMissing(f"layers {self.config.layers} hold {have} tokens of this "
                                 f"prompt's prefix, not the {prefix_tokens} asked for")
        seq = self._new_sequence(ids, params, request_id)
        seq.hold_kv = hold_kv
        if self.staged:
            seq.staged, seq.prefix_tokens = True, prefix_tokens
            if not self.model.is_first:
                seq.stage_input = StageInput()
        self.scheduler.add(seq)
        return seq.request_id

    def feed(self, request_id: str, start: int, residual: torch.Tensor,
             x: torch.Tensor) -> None:
        """A later pipeline stage: the previous stage's output (a `RequestOutput.boundary`)
        for prompt positions ``[start, start + rows)`` of ``request_id``; chunks come in order,
        each starting where the last ended. Raises `InputError` (and keeps nothing) for an
        unknown request, a first stage, rows out of order or of the wrong shape."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.stage_input is None:
            raise InputError(f"request {request_id!r} is not waiting for a stage's input here"
                             + ("" if seq is None else " (this is the first stage)"))
        inp = seq.stage_input
        n = residual.shape[0] if residual.dim() == 2 else -1
        hidden = self.model_config.hidden_size
        if residual.shape != (n, hidden) or x.shape != residual.shape or n < 1:
            raise InputError(f"stage input rows must be two [rows, {hidden}] tensors, got "
                             f"{tuple(residual.shape)} and {tuple(x.shape)}")
        if start != (inp.available if inp.start >= 0 else start) or start < 0 \
                or start + n > len(seq.prompt_ids):
            raise InputError(f"stage input for positions {start}..{start + n} does not follow "
                             f"the {inp.available} received of {len(seq.prompt_ids)}")
        if inp.start < 0:
            have = self.scheduler.cached_tokens(seq.prompt_ids, seq.prefix_tokens)
            if start > have:
                raise InputError(f"stage input starts at position {start}, but layers "
                                 f"{self.config.layers} hold only {have} tokens of its prefix")
            inp.start = start
        inp.residual.append(residual.to(self.device, self.dtype))
        inp.x.append(x.to(self.device, self.dtype))
        inp.available = start + n

    def _new_sequence(self, ids: list[int], params: SamplingParams,
                      request_id: str | None) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise InputError("params must be a SamplingParams")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs or rid in self._held:
            raise InputError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, ids, params, next(self._arrival), generator=make_generator(params))
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids)
        self._seqs[rid] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request (every choice) now and free its KV (also held KV); False if unknown
        or released."""
        released = self.release(request_id)
        seqs = [s for s in self._seqs.values() if s.group == request_id]
        for seq in seqs:
            del self._seqs[seq.request_id]
            self.scheduler.free(seq)
            seq.phase, seq.finish = Phase.ABORTED, FinishReason.ABORT
        return released or bool(seqs)

    def release(self, request_id: str) -> bool:
        """Free the blocks of a finished ``hold_kv`` request; False if none is held."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.allocator.release_all(seq.blocks)
        seq.blocks = []
        return True

    def held_sequence(self, request_id: str) -> Sequence | None:
        return self._held.get(request_id)

    def has_unfinished(self) -> bool:
        """Whether a request is still running or `step` has outputs left to return."""
        return bool(self._seqs) or bool(self._deferred)

    def add_layer_hook(self, hook: LayerHook) -> None:
        """``hook(layer, meta)`` runs right after each layer wrote its K/V (every step)."""
        self.model.hooks.append(hook)

    def remove_layer_hook(self, hook: LayerHook) -> None:
        self.model.hooks.remove(hook)

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    # ------------------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        """Run one batch step; returns outputs of requests that produced tokens or ended (first
        those deferred from other requests while `generate` / `stream` ran)."""
        outputs, self._deferred = self._deferred, []
        outputs += [self._finish_now(s) for s in list(self._seqs.values())
                    if s.params.max_tokens == 0 and s.phase == Phase.WAITING]
        plan = self.scheduler.schedule()
        if plan.empty:
            return outputs
        self.current_plan = plan
        started = time.perf_counter()
        try:
            logits, sampled = self.runner.run(plan)
        finally:
            self.current_plan = None
        self.scheduler.observe(plan, time.perf_counter() - started)
        starts = [seq.num_computed for seq, _ in plan.prefills]
        self.scheduler.commit(plan)
        self.last_plan = plan
        self.num_steps += 1
        if isinstance(logits, Boundary):  # a stage before the last: hand the rows on
            return outputs + self._boundaries(plan, starts, logits)
        if sampled and self.logits_hook is not None:
            self.logits_hook([s.request_id for s in sampled], logits)
        if sampled:
            logits, sampled = self._forks(logits, sampled)
            result = sample(logits, [s.params for s in sampled], [s.generator for s in sampled],
                            [self._banned(s) for s in sampled])
            for seq, tok, lp in zip(sampled, result.token_ids, result.logprobs, strict=True):
                outputs.append(self._append(seq, tok, lp))
        return outputs

    def _forks(self, logits: torch.Tensor, sampled: list[Sequence]
               ) -> tuple[torch.Tensor, list[Sequence]]:
        """The rows to sample: every sequence of ``sampled``, each ``n > 1`` request that just
        finished its prefill followed by its new choices 1..n-1 (`_fork`), which sample from
        its logits row."""
        if all(s.params.n == 1 or s.output_ids for s in sampled):
            return logits, sampled
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, seq in enumerate(sampled):
            rows.append(row)
            seqs.append(seq)
            if seq.params.n > 1 and not seq.output_ids and seq.index == 0:
                for j in range(1, seq.params.n):
                    rows.append(row)
                    seqs.append(self._fork(seq, j, share_kv=seq.params.max_tokens > 1))
        return logits.index_select(0, torch.as_tensor(rows, device=logits.device)), seqs

    def _fork(self, parent: Sequence, j: int, share_kv: bool = True) -> Sequence:
        """Choice ``j`` of ``parent``'s request (whose prompt's KV is computed): a running
        sequence with the prompt's full blocks shared (one more reference each) and its
        partly filled last block copied (copy on write; when no block is free, that tail is
        recomputed instead). ``share_kv=False``: no KV (a choice that ends at its first token,
        e.g. on a prefill instance)."""
        params = parent.params.choice(j)
        child = Sequence(f"{parent.request_id}#{j}", parent.prompt_ids, params,
                         parent.arrival, generator=make_generator(params), group=parent.group,
                         index=j, num_cached_tokens=parent.num_cached_tokens)
        if self.tokenizer is not None:
            child.detok = IncrementalDetokenizer(self.tokenizer, child.prompt_ids)
        self._seqs[child.request_id] = child
        if not share_kv:
            return child
        bs, alloc = self.block_size, self.allocator
        full = parent.num_computed // bs
        for b in parent.blocks[:full]:
            alloc.acquire(b)
        child.blocks, child.keys = parent.blocks[:full], parent.keys[:full]
        child.num_computed = full * bs
        if parent.num_computed % bs and alloc.num_free:
            block = alloc.allocate()
            self.pool.copy_block(parent.blocks[full], block)
            child.blocks.append(block)
            child.num_computed = parent.num_computed
        child.phase = Phase.RUNNING
        self.scheduler.running.append(child)
        return child

    def _boundaries(self, plan: StepPlan, starts: list[int],
                    out: Boundary) -> list[RequestOutput]:
        """A stage before the last: one output per prefill chunk with its rows; a sequence
        whose whole prompt is through ends (its KV stays for the caller to ship or hold)."""
        outputs = []
        row = 0
        for (seq, n), start in zip(plan.prefills, starts, strict=True):
            rows = (start, out.residual[row:row + n], out.x[row:row + n])
            row += n
            if not seq.is_prefilling:
                seq.finish = FinishReason.LENGTH
            result = self._output(seq, [], "")
            result.boundary = rows
            outputs.append(result)
        return outputs

    def _banned(self, seq: Sequence) -> frozenset[int]:
        """Stop tokens ``seq`` may not sample yet: until ``min_tokens`` are out, its stop ids
        and (unless ``ignore_eos``) EOS are masked, as vLLM does."""
        p = seq.params
        if len(seq.output_ids) >= p.min_tokens:
            return frozenset()
        return (frozenset() if p.ignore_eos else self.eos_token_ids).union(p.stop_token_ids)

    def _finish_now(self, seq: Sequence) -> RequestOutput:
        seq.finish = FinishReason.LENGTH
        return self._output(seq, [], "")

    def _append(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        p = seq.params
        seq.output_ids.append(token)
        seq.logprobs.append(lp)
        if isinstance(seq.detok, IncrementalDetokenizer):
            seq.detok.add(token)
            seq.text = seq.detok.text
        n = len(seq.output_ids)
        if n >= p.min_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                seq.finish = FinishReason.STOP
            for stop in p.stop:
                at = seq.text.find(stop, max(0, seq.emitted - len(stop)))
                if at >= 0:
                    seq.finish, seq.text = FinishReason.STOP, seq.text[:at]
        if seq.finish == FinishReason.NONE and (
                n >= p.max_tokens or seq.num_tokens >= self.max_model_len or seq.staged):
            seq.finish = FinishReason.LENGTH  # a pipeline stage only prefills
        # hold back a tail that could still become a stop string
        hold = 0 if seq.finish != FinishReason.NONE else max(map(len, p.stop), default=1) - 1
        upto = max(seq.emitted, len(seq.text) - hold)
        delta, seq.emitted = seq.text[seq.emitted:upto], upto
        return self._output(seq, [token], delta)

    def _output(self, seq: Sequence, new: list[int], delta: str) -> RequestOutput:
        finished = seq.finish != FinishReason.NONE
        if finished:
            seq.phase = Phase.FINISHED
            self._seqs.pop(seq.request_id, None)
            if seq.hold_kv:
                self.scheduler.detach(seq)
                self._held[seq.request_id] = seq
            else:
                self.scheduler.free(seq)
        done = finished and (seq.params.n == 1 and seq.index == 0
                             or not any(s.group == seq.group for s in self._seqs.values()))
        return RequestOutput(seq.group, new, delta, list(seq.output_ids), seq.text, finished,
                             seq.finish.label, len(seq.prompt_ids), seq.num_cached_tokens,
                             seq.logprobs[-1:] if new else [], seq.index, done)

    # ------------------------------------------------------------------------ helpers

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` to completion together; final outputs in prompt order. Requests
        queued before advance too; their outputs are deferred to the next `step`."""
        rids = [self.add_request(p, params, chat=chat) for p in prompts]
        final = {out.request_id: out for out in self._own_outputs(set(rids))
                 if out.finished and out.index == 0}
        return [final[r] for r in rids]

    def stream(self, prompt: str | Seq[int] | list[dict[str, str]],
               params: SamplingParams | None = None, chat: bool = False
               ) -> Iterator[RequestOutput]:
        """Yield this request's outputs as they come (other queued requests also advance;
        their outputs are deferred to the next `step`)."""
        yield from self._own_outputs({self.add_request(prompt, params, chat=chat)})

    def _own_outputs(self, rids: set[str]) -> Iterator[RequestOutput]:
        """Step until every request of ``rids`` finished (or was aborted), yielding their
        outputs; the others' outputs (and those deferred before) wait for the next `step`."""
        left = set(rids)
        while any(s.group in left for s in self._seqs.values()):
            deferred, self._deferred = self._deferred, []
            for out in self.step():
                if out.request_id in left:
                    yield out
                    if out.finished and out.done:
                        left.discard(out.request_id)
                else:
                    deferred.append(out)
            self._deferred = deferred + self._deferred

    def signature(self) -> dict[str, str]:
        """What this engine runs, as the Conductor's predictors are keyed: weights, dtype,
        device, threads, the matmul path and attention paths chosen at start-up, kernels,
        invariance, the step budget and the machine (its best matmul ISA: oneDNN's packed bf16
        path runs on AMX tiles where the CPU has them). Two engines with equal signatures take
        the same time per step. Fixed once the engine is built (a copy each call)."""
        return dict(self._signature)

    def _describe(self) -> dict[str, str]:
        c = self.config
        return {"model": self.weights_fingerprint, "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device), "threads": str(torch.get_num_threads()),
                "attention": self.attention, "prefill_attention": self.prefill_attention,
                "decode_fused": self.decode_fused,
                "kernels": self.kernels.name, "batch_invariant": str(c.batch_invariant).lower(),
                "matmul": ("onednn-packed" + (f" mm:{self.matmul_routes}"
                                              if self.matmul_routes else "")
                           + (f" amx:{self.amx_routes}" if self.amx_routes else ""))
                if self.model.packed else "F.linear",
                "max_batch_tokens": str(c.max_batch_tokens), "block_size": str(c.block_size),
                "machine": runtime.machine() if self.device.type == "cpu" else
                torch.cuda.get_device_name(self.device)}

    def stats(self) -> dict[str, float]:
        a = self.allocator
        return {"steps": self.num_steps, "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting), "free_blocks": a.num_free,
                "total_blocks": a.num_blocks, "cached_blocks": a.num_cached,
                "prefix_hit_blocks": a.stats.hit_blocks,
                "prefix_queried_blocks": a.stats.queried_blocks,
                "preemptions": self.scheduler.num_preemptions}

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny forward pass so the first request does not pay one-time costs."""
        n = max(1, min(4, self.max_model_len - 2))
        ids = [i % self.model_config.vocab_size for i in range(n)]
        if not self.staged:
            self.generate([ids], SamplingParams(max_tokens=1, temperature=0))
            return
        rid = self.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        if not self.model.is_first:  # a later stage: zero rows stand for the previous one's
            rows = torch.zeros(n, self.model_config.hidden_size)
            self.feed(rid, 0, rows, rows)
        while self.has_unfinished():
            self.step()
        self.abort(rid)
