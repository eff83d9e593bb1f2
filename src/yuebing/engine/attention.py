"""Paged attention over the KV pool: the torch paths and the registry of all paths; called by
`LlamaModel.forward` once per layer and step.

A step's tokens are laid out flat: one per decoding sequence, then each prefilling sequence's
chunk. Each layer writes its new K/V at the tokens' slots (`write_kv`), then runs **decode**
for all decoding sequences at once (contexts gathered with one ``index_select``; ``grouped``
matmuls or ``sdpa``) and **prefill** per sequence (cached prefix + chunk, causal mask offset).
Batch-invariant engines run one `TOKEN_IMPLS` path per token instead. Other modules register
more paths (``paged``, ``flash``, ``blas``); `choose_attention` times the allowed ones at start.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from yuebing.engine.choices import interleaved_times


@dataclass
class PrefillSlice:
    """One prefilling sequence in a step: tokens ``[start, start+length)`` of the flat batch."""

    start: int
    length: int
    context_len: int
    """Tokens of context after this chunk (cached + earlier chunks + this chunk)."""
    head_index: torch.Tensor
    """Gather index into the per-layer pool viewed as ``[blocks·kv_heads, bs, hd]``."""
    mask: torch.Tensor | None
    """Boolean ``[length, context_len]`` (True = attend) or None for a causal start."""
    block_table: torch.Tensor | None = None
    """int64 ``[blocks]`` of the sequence's context (paths reading the pool in place)."""


@dataclass
class AttnMetadata:
    """Where a step's tokens live in the pool and what they attend to (shared by all layers)."""

    slot_index: torch.Tensor
    """``[T·kv_heads]`` rows of the per-layer pool viewed as ``[blocks·kv_heads·bs, hd]``."""
    num_decode: int
    decode_index: torch.Tensor | None
    """``[D·kv_heads·max_blocks]`` gather index for the decoding sequences."""
    decode_max_len: int
    """Keys attended per decoding sequence (the runner uses whole blocks: max blocks × bs)."""
    decode_bias: torch.Tensor | None
    """Additive ``[D, 1, max_len]`` mask (0 / -inf) hiding keys past each context, or None."""
    prefills: list[PrefillSlice]
    slots: torch.Tensor | None = None
    """``[T]`` int64 slot ``block·block_size + offset`` of each token (native KV write)."""
    decode_table: torch.Tensor | None = None
    """``[D, max_blocks]`` int32 block table of the decoding sequences (native decode)."""
    decode_lens: torch.Tensor | None = None
    """``[D]`` int32 context length of each decoding sequence, this step's token included."""
    token_table: torch.Tensor | None = None
    """``[T, max_blocks]`` int32 block table of every token of the step (batch-invariant mode:
    each token attends alone to its own context; None otherwise)."""
    token_lens: torch.Tensor | None = None
    """``[T]`` int32 context length of every token, itself included (batch-invariant mode)."""


def head_index(block_ids: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows ``block·kv_heads + head`` ordered (sequence, head, block) for the gather."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)
    if block_ids.dim() == 1:
        return (block_ids[None, :] * num_kv_heads + heads[:, None]).reshape(-1)
    return (block_ids[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)


def slot_index(blocks: torch.Tensor, offsets: torch.Tensor, num_kv_heads: int,
               block_size: int) -> torch.Tensor:
    """Row of (token, head) in a per-layer pool viewed as ``[blocks·kv_heads·bs, hd]``."""
    heads = torch.arange(num_kv_heads, device=blocks.device) * block_size
    base = blocks * (num_kv_heads * block_size) + offsets
    return (base[:, None] + heads[None, :]).reshape(-1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttnMetadata) -> None:
    """Store ``k``/``v`` ``[T, kv_heads, hd]`` at the tokens' slots of one layer's pool."""
    hd = k.shape[-1]
    k_cache.view(-1, hd).index_copy_(0, meta.slot_index, k.reshape(-1, hd))
    v_cache.view(-1, hd).index_copy_(0, meta.slot_index, v.reshape(-1, hd))


def gather_blocks(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of one layer's pool viewed as ``[blocks·kv_heads, bs, hd]`` (a copy)."""
    nb, kvh, bs, hd = cache.shape
    return cache.view(nb * kvh, bs, hd).index_select(0, index)


def _decode_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
               d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the ``d`` decoding sequences, ``[d, kv_heads, decode_max_len, hd]``."""
    assert meta.decode_index is not None
    kvh, hd = k_cache.shape[1], k_cache.shape[-1]
    length = meta.decode_max_len
    k = gather_blocks(k_cache, meta.decode_index).view(d, kvh, -1, hd)[:, :, :length]
    v = gather_blocks(v_cache, meta.decode_index).view(d, kvh, -1, hd)[:, :, :length]
    return k, v


def decode_grouped(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttnMetadata, scale: float) -> torch.Tensor:
    """``q [D, heads, hd]`` (may be a strided view) → ``[D, heads, hd]`` via grouped matmuls
    over gathered blocks."""
    d, heads, hd = q.shape
    kvh, length = k_cache.shape[1], meta.decode_max_len
    k, v = (t.flatten(0, 1) for t in _decode_kv(k_cache, v_cache, meta, d))  # views
    # scores in float32: bf16-rounded logits of large attention scores visibly hurt outputs
    qg = (q.float() * scale).reshape(d * kvh, heads // kvh, hd)
    scores = torch.bmm(qg, k.float().transpose(1, 2))
    if meta.decode_bias is not None:
        scores = scores.view(d, -1, length).add_(meta.decode_bias).view(d * kvh, -1, length)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, v).view(d, heads, hd)


def decode_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:
    """Same result as `decode_grouped` through ``scaled_dot_product_attention``."""
    d, heads, hd = q.shape
    k, v = _decode_kv(k_cache, v_cache, meta, d)
    mask = None if meta.decode_bias is None else meta.decode_bias[:, None].to(q.dtype)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.view(d, heads, hd)


DECODE_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "grouped": decode_grouped, "sdpa": decode_sdpa}
DECODE_SUPPORTS: dict[str, Callable[[torch.dtype, torch.device], bool]] = {}
"""Decode implementations that only run on some dtypes/devices (absent = any)."""


def register_decode(name: str, fn: Callable[..., torch.Tensor],
                    supports: Callable[[torch.dtype, torch.device], bool]) -> None:
    """Add a decode implementation (called by modules that provide one when imported)."""
    DECODE_IMPLS[name] = fn
    DECODE_SUPPORTS[name] = supports


def decode_supported(name: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode implementation ``name`` exists here and runs on ``dtype``/``device``."""
    return name in DECODE_IMPLS and DECODE_SUPPORTS.get(name, lambda *_: True)(dtype, device)


def prefill_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sl: PrefillSlice, scale: float) -> torch.Tensor:
    """``q [n, heads, hd]`` of one sequence's chunk → ``[n, heads, hd]`` through SDPA."""
    kvh, hd = k_cache.shape[1], k_cache.shape[-1]
    k = gather_blocks(k_cache, sl.head_index).view(kvh, -1, hd)[None, :, :sl.context_len]
    v = gather_blocks(v_cache, sl.head_index).view(kvh, -1, hd)[None, :, :sl.context_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=sl.mask, is_causal=sl.mask is None,
        scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def prefill_grouped(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    sl: PrefillSlice, scale: float, tile: int = 256) -> torch.Tensor:
    """Same as `prefill_sdpa` with grouped matmuls over query tiles: each tile of queries
    attends only to keys up to its last position (causal); scores in float32 (bf16-rounded
    scores turned SmolLM2's answers into nonsense)."""
    n, heads, hd = q.shape
    kvh = k_cache.shape[1]
    g = heads // kvh
    ctx, offset = sl.context_len, sl.context_len - n
    k = gather_blocks(k_cache, sl.head_index).view(kvh, -1, hd)[:, :ctx].float()
    v = gather_blocks(v_cache, sl.head_index).view(kvh, -1, hd)
    qg = (q.float() * scale).view(n, kvh, g, hd).permute(1, 0, 2, 3).reshape(kvh, n * g, hd)
    out = torch.empty(kvh, n * g, hd, dtype=q.dtype, device=q.device)
    keys = torch.arange(ctx, device=q.device)
    for s0 in range(0, n, tile):
        s1 = min(n, s0 + tile)
        end = offset + s1  # keys this tile may see
        scores = torch.bmm(qg[:, s0 * g:s1 * g], k[:, :end].transpose(1, 2))
        rows = torch.arange(offset + s0, offset + s1, device=q.device)
        hide = keys[None, :end] > rows[:, None]  # [tile, end]
        scores = scores.view(kvh, s1 - s0, g, end).masked_fill_(hide[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[:, s0 * g:s1 * g] = torch.bmm(probs.view(kvh, (s1 - s0) * g, end), v[:, :end])
    return out.view(kvh, n, g, hd).permute(1, 0, 2, 3).reshape(n, heads, hd)


PREFILL_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "grouped": prefill_grouped, "sdpa": prefill_sdpa}


def tokens_loop(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:
    """Batch-invariant attention in torch: ``q [T, heads, hd]`` of every token of a step (decode
    and prefill alike) → ``[T, heads, hd]``, each token alone over exactly its own context
    (``meta.token_table`` / ``token_lens``) in float32. A token's operations and their shapes
    depend only on its position, so its result is the same whatever else the step holds. One
    small loop per token: the fallback where the native ``paged`` kernel does not run."""
    assert meta.token_table is not None and meta.token_lens is not None
    t, heads, hd = q.shape
    kvh, bs = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(t, heads, hd, dtype=q.dtype, device=q.device)
    lens = meta.token_lens.tolist()
    for i, n in enumerate(lens):
        index = head_index(meta.token_table[i, : -(-n // bs)].long(), kvh)
        k = gather_blocks(k_cache, index).view(kvh, -1, hd)[:, :n].float()
        v = gather_blocks(v_cache, index).view(kvh, -1, hd)[:, :n].float()
        qg = (q[i].float() * scale).view(kvh, heads // kvh, hd)
        probs = torch.softmax(torch.bmm(qg, k.transpose(1, 2)), dim=-1)
        out[i] = torch.bmm(probs, v).view(heads, hd).to(q.dtype)
    return out


TOKEN_IMPLS: dict[str, Callable[..., torch.Tensor]] = {"loop": tokens_loop}
"""Batch-invariant attention over ``AttnMetadata.token_table`` (``loop`` here; the native
kernels add ``paged``)."""

Supports = Callable[[torch.dtype, torch.device], bool]
PREFILL_SUPPORTS: dict[str, Supports] = {}
"""Implementations that only run on some dtypes/devices (absent = any); `choose_attention` and
`EngineConfig` checks consult it."""


def register_prefill(name: str, fn: Callable[..., torch.Tensor], supports: Supports) -> None:
    """Add a prefill implementation (called by modules that provide one when imported)."""
    PREFILL_IMPLS[name] = fn
    PREFILL_SUPPORTS[name] = supports


def prefill_supported(name: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prefill implementation ``name`` exists here and runs on ``dtype``/``device``."""
    return name in PREFILL_IMPLS and PREFILL_SUPPORTS.get(name, lambda *_: True)(dtype, device)


def causal_mask(length: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """Chunk of ``length`` new tokens at the end of ``context_len``: query i sees keys ≤ i+off."""
    if length == context_len:
        return None
    offset = context_len - length
    rows = torch.arange(length, device=device)[:, None] + offset
    return torch.arange(context_len, device=device)[None, :] <= rows


def choose_attention(num_kv_heads: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device, batch: int = 8, context: int = 512,
                     repeats: int = 5, decode_names: Collection[str] | None = None,
                     prefill_names: Collection[str] | None = None
                     ) -> tuple[str, str, dict[str, float]]:
    """Time the decode and prefill paths on this device/dtype; return the faster names
    (decode, prefill) and all timings in seconds. ``decode_names`` / ``prefill_names`` limit
    the candidates (default: every registered one that supports this dtype/device).

    With ``attention`` / ``prefill_attention`` = ``auto`` the engine keeps the fastest path of each
    kind; registered paths name the dtypes and devices they run on (`register_decode`,
    `register_prefill`): ``paged`` decode and ``flash`` prefill over the native kernels
    (`engine.kernels`; ``flash_amx`` too where the CPU has AMX-BF16 tiles), ``blas`` prefill on
    MKL's bf16 GEMM (`engine.blas_attention`). In
    batch-invariant mode every token attends alone to its own context (``tokens_loop``, or the
    native ``paged`` kernel), so its result does not depend on the rest of the batch."""
    bs = 16
    blocks = batch * context // bs
    k_cache = torch.randn(blocks, num_kv_heads, bs, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(blocks, device=device).view(batch, -1)
    meta = AttnMetadata(torch.zeros(0, dtype=torch.long), batch,
                        head_index(table, num_kv_heads), context, None, [],
                        decode_table=table.to(torch.int32),
                        decode_lens=torch.full((batch,), context, dtype=torch.int32,
                                               device=device))
    q = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    decodes = {name: fn for name, fn in DECODE_IMPLS.items()
               if (decode_names is None or name in decode_names)
               and decode_supported(name, dtype, device)}
    timings = {f"decode_{name}": t for name, t in interleaved_times(
        {name: partial(fn, q, k_cache, v_cache, meta, scale) for name, fn in decodes.items()},
        device, repeats).items()}
    n = context // 2  # a chunk on top of as many cached tokens
    sl = PrefillSlice(0, n, context, head_index(table[0], num_kv_heads),
                      causal_mask(n, context, device), table[0])
    qp = torch.randn(n, num_heads, head_dim, device=device).to(dtype)
    prefills = {name: fn for name, fn in PREFILL_IMPLS.items()
                if (prefill_names is None or name in prefill_names)
                and prefill_supported(name, dtype, device)}
    timings.update({f"prefill_{name}": t for name, t in interleaved_times(
        {name: partial(fn, qp, k_cache, v_cache, sl, scale) for name, fn in prefills.items()},
        device, repeats).items()})

    def pick(kind: str, names: dict[str, Callable[..., torch.Tensor]]) -> str:
        return min(names, key=lambda name: timings[f"{kind}_{name}"])

    return pick("decode", decodes), pick("prefill", prefills), timings
