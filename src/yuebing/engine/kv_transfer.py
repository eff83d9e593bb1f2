"""Moving KV between engines: whole blocks, whole requests, or layer by layer.

The decode role reserves blocks for a request whose KV a prefill streams in (`reserve_blocks`)
and adopts it once it landed (`adopt_request`, `adopt_choices` for n > 1); the KV connector and
the peer fetch install a loaded prefix in the prefix cache (`import_prefix`). The other forms
(`export_request` / `import_request`, `export_prefix`, `LayerStreamer`) are the engine's API,
used by its tests only: the prefill role streams with its own hook
(`instance.streaming.KvStreamer`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from yuebing.core.errors import EngineError, InputError
from yuebing.core.ids import BlockHash
from yuebing.engine.attention import AttnMetadata
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.sequence import RequestOutput, Sequence


@dataclass
class RequestKV:
    """The KV of the first ``num_tokens`` of ``token_ids``, as whole blocks."""

    token_ids: list[int]
    num_tokens: int
    block_size: int
    fingerprint: str
    data: torch.Tensor
    keys: list[BlockHash] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def export_request(engine: LLMEngine, request_id: str) -> RequestKV:
    """Snapshot a live request's KV (all tokens computed so far).

    Engine API: the KV of a request's computed tokens as one contiguous ``[blocks, layers, 2,
    kv_heads, block_size, head_dim]`` buffer plus its tokens (`RequestKV`)."""
    seq = engine.get_sequence(request_id)
    if seq is None:
        raise InputError(f"unknown or finished request {request_id!r}")
    if seq.num_computed == 0:
        raise InputError(f"request {request_id!r} has no computed KV yet; step the engine first")
    n = -(-seq.num_computed // engine.block_size)
    data = engine.pool.export_blocks(seq.blocks[:n])
    return RequestKV(seq.all_ids, seq.num_computed, engine.block_size, engine.fingerprint, data,
                     list(seq.keys))


def _check(engine: LLMEngine, fingerprint: str, block_size: int) -> None:
    if fingerprint != engine.fingerprint:
        raise InputError(f"KV was computed by model {fingerprint!r}, this engine runs "
                         f"{engine.fingerprint!r}")
    if block_size != engine.block_size:
        raise InputError(f"KV uses block size {block_size}, this engine {engine.block_size}")


def import_request(engine: LLMEngine, kv: RequestKV, params: SamplingParams,
                   request_id: str | None = None, prompt_len: int | None = None) -> str:
    """Queue a request whose first ``kv.num_tokens`` tokens' KV is given; returns its id.

    Tokens after ``prompt_len`` (default: all) count as already generated output.
    """
    _check(engine, kv.fingerprint, kv.block_size)
    ids = engine.encode_prompt(kv.token_ids)
    if not 0 < kv.num_tokens < len(ids):
        raise InputError(f"KV covers {kv.num_tokens} of {len(ids)} tokens; it must leave at "
                         "least the last token to compute")
    n = -(-kv.num_tokens // engine.block_size)
    if kv.data.shape[0] < n or tuple(kv.data.shape[1:]) != engine.pool.block_shape:
        raise InputError(f"KV buffer shape {tuple(kv.data.shape)} does not hold {n} blocks of "
                         f"{engine.pool.block_shape}")
    split = len(ids) if prompt_len is None else prompt_len
    if not 0 < split <= len(ids):
        raise InputError(f"prompt_len must be in 1..{len(ids)}, got {prompt_len}")
    if n > engine.allocator.num_free:
        raise EngineError(f"KV cache has {engine.allocator.num_free} free blocks, the "
                          f"imported request needs {n}")
    seq = engine._new_sequence(ids[:split], params, request_id)  # checks id and params first
    blocks = engine.allocator.allocate_many(n)
    engine.pool.import_blocks(blocks, kv.data[:n])
    seq.output_ids = ids[split:]
    seq.blocks, seq.num_computed, seq.num_cached_tokens = blocks, kv.num_tokens, kv.num_tokens
    engine.scheduler.publish(seq)
    engine.scheduler.add(seq)
    return seq.request_id


def reserve_blocks(engine: LLMEngine, num_tokens: int) -> list[int]:
    """Allocate the blocks a request of ``num_tokens`` prompt tokens will need, before its KV
    arrives (decode side); `EngineError` when the pool cannot hold them now."""
    if not 0 < num_tokens < engine.max_model_len:
        raise InputError(f"a prompt of {num_tokens} tokens does not fit the context of "
                         f"{engine.max_model_len}")
    n = -(-num_tokens // engine.block_size)
    if n > engine.allocator.num_free:
        raise EngineError(f"KV cache has {engine.allocator.num_free} free blocks, the request "
                          f"needs {n}")
    return engine.allocator.allocate_many(n)


def adopt_request(engine: LLMEngine, request_id: str, prompt_ids: Seq[int], blocks: list[int],
                  first_token: int, params: SamplingParams,
                  cached_tokens: int = 0) -> RequestOutput:
    """Continue a request whose prompt KV was written into ``blocks`` (from `reserve_blocks`)
    and whose first token was sampled elsewhere: the blocks become the request's (published in
    the prefix cache), the first token is appended with the usual stop checks, and unless that
    ended it the request joins the batch. Returns the first token's output."""
    return adopt_choices(engine, request_id, prompt_ids, blocks, [first_token], params,
                         cached_tokens)[0]


def adopt_choices(engine: LLMEngine, request_id: str, prompt_ids: Seq[int], blocks: list[int],
                  first_tokens: Seq[int], params: SamplingParams,
                  cached_tokens: int = 0) -> list[RequestOutput]:
    """`adopt_request` for a request of ``params.n`` choices whose first tokens (one per
    choice, sampled elsewhere from the one prefill) are ``first_tokens``: choices 1..n-1 fork
    from the adopted prompt KV (shared full blocks, the last one copied). Returns each
    choice's first output, in choice order."""
    ids = engine.encode_prompt(list(prompt_ids))
    n = -(-len(ids) // engine.block_size)
    if len(blocks) != n:
        raise InputError(f"{len(blocks)} blocks cannot hold a prompt of {len(ids)} tokens "
                         f"({n} blocks of {engine.block_size})")
    if len(first_tokens) != params.n:
        raise InputError(f"{len(first_tokens)} first tokens for a request of n={params.n}")
    vocab = engine.model_config.vocab_size
    if not all(isinstance(t, int) and 0 <= t < vocab for t in first_tokens):
        raise InputError(f"a first token of {list(first_tokens)} is not in the vocabulary")
    seq = engine._new_sequence(ids, params, request_id)
    seq.blocks, seq.num_computed = list(blocks), len(ids)
    seq.num_cached_tokens = cached_tokens
    engine.scheduler.publish(seq)
    choices = [seq] + [engine._fork(seq, j) for j in range(1, params.n)]
    outs = []
    for choice, token in zip(choices, first_tokens, strict=True):
        out = engine._append(choice, token, None)
        if not out.finished:
            # the first token's text went to the client with the first token (from the
            # prefill, which applied the same stop strings); later deltas start after it
            choice.emitted = len(choice.text)
            if choice is seq:
                engine.scheduler.add(seq)
        outs.append(out)
    return outs


def export_prefix(engine: LLMEngine, token_ids: Seq[int]) -> tuple[list[BlockHash], torch.Tensor]:
    """Keys and KV of the longest cached run of full blocks of ``token_ids``."""
    ids = list(token_ids)
    keys = engine.block_keys(ids)
    bs = engine.block_size
    hits = engine.allocator.match_prefix(keys, [ids[i * bs:(i + 1) * bs]
                                                for i in range(len(keys))])
    return keys[: len(hits)], engine.pool.export_blocks(hits)


def import_prefix(engine: LLMEngine, token_ids: Seq[int], data: torch.Tensor,
                  fingerprint: str) -> int:
    """Insert the KV of the first ``len(data)`` full blocks of ``token_ids`` into the prefix
    cache (e.g. loaded from the store); returns how many blocks were new.

    ``fingerprint`` is the KV fingerprint of the engine that computed ``data``; it must equal
    this engine's (`InputError` otherwise, and when it is missing: KV of unknown origin is
    never accepted)."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise InputError("import_prefix needs the fingerprint of the engine that computed the "
                         "KV; KV of unknown origin is refused")
    _check(engine, fingerprint, engine.block_size)
    ids = list(token_ids)
    keys = engine.block_keys(ids)
    if data.shape[0] > len(keys) or tuple(data.shape[1:]) != engine.pool.block_shape:
        raise InputError(f"prefix KV shape {tuple(data.shape)} does not fit {len(keys)} full "
                         f"blocks of {engine.pool.block_shape}")
    bs, alloc = engine.block_size, engine.allocator
    present, missing = [], []
    for i in range(data.shape[0]):
        block = alloc.lookup(keys[i], ids[i * bs:(i + 1) * bs])
        if block is None:
            missing.append(i)
        else:
            alloc.acquire(block)  # held so that allocating the missing ones cannot evict it
            present.append(block)
    try:
        if len(missing) > alloc.num_free:
            raise EngineError(f"KV cache has {alloc.num_free} free blocks, the prefix needs "
                              f"{len(missing)}")
        if missing:
            blocks = alloc.allocate_many(len(missing))
            run = missing == list(range(missing[0], missing[-1] + 1))
            engine.pool.import_blocks(blocks, data[missing[0]:missing[-1] + 1] if run
                                      else data[torch.tensor(missing)])
            for block, i in zip(blocks, missing, strict=True):
                alloc.register(block, keys[i], ids[i * bs:(i + 1) * bs])
                alloc.release(block)
    finally:
        alloc.release_all(present)
    return len(missing)


LayerSink = Callable[[str, int, list[int], torch.Tensor], None]
"""``sink(request_id, layer, block_ids, kv [2, n, kv_heads, bs, hd])``."""


class LayerStreamer:
    """Layer hook shipping watched requests' KV of each layer as soon as it is written.

    For every step, after layer i wrote its K/V, ``sink`` receives layer i of the blocks the
    step touched for each watched request (a view when the blocks are consecutive). The sink
    must copy what it keeps before returning if it wants the data of a view to stay fixed.
    """

    def __init__(self, engine: LLMEngine, sink: LayerSink) -> None:
        self.engine = engine
        self.sink = sink
        self.watched: set[str] = set()
        engine.add_layer_hook(self)

    def watch(self, request_id: str) -> None:
        self.watched.add(request_id)

    def unwatch(self, request_id: str) -> None:
        self.watched.discard(request_id)

    def close(self) -> None:
        self.engine.remove_layer_hook(self)

    def _touched(self) -> list[tuple[Sequence, list[int]]]:
        plan = self.engine.current_plan
        if plan is None:
            return []
        bs = self.engine.block_size
        work = [(s, 1) for s in plan.decodes] + list(plan.prefills)
        out = []
        for seq, n in work:
            if seq.request_id in self.watched:
                first, end = seq.num_computed // bs, -(-(seq.num_computed + n) // bs)
                out.append((seq, seq.blocks[first:end]))
        return out

    def __call__(self, layer: int, meta: AttnMetadata) -> None:
        for seq, blocks in self._touched():
            self.sink(seq.request_id, layer, blocks, self.engine.pool.export_layer(layer, blocks))
