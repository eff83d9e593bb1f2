"""Fused small-batch decode: each decoder layer (and the final norm with the LM head) as one
native op (``torch.ops.yuebing.decode_layer`` / ``decode_logits``).

A b=1 step of the op-by-op path runs ~15 small ops per layer, each paying dispatch and a thread
fork/join; the fused op pays one. `FusedDecode` holds the weights the ops read, beside oneDNN's
packed ones: where the ops run on AMX tiles (`tiles_available`: an AMX-BF16 CPU that grants the
tiles) in `amx_linear.pack`'s tiles, up to `TILE_ROWS` rows (one tile product serves every row,
so a batch of 8 costs little more than one); else row-major for AVX512-BF16 dot products, up
to `MAX_ROWS`. The engine builds it at start-up where the native kernels run bf16 with
AVX512-BF16 outside batch-invariant mode, and `choose_max_rows` times it against the op-by-op
path on this machine; `LlamaModel.forward` uses it for decode-only steps of at most
``max_rows`` sequences, and its LM head for any step with at most `FusedDecode.limit` logits
rows.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from yuebing.engine import amx_linear, native
from yuebing.engine.attention import AttnMetadata, head_index, slot_index
from yuebing.engine.config import ModelConfig

log = logging.getLogger(__name__)

MAX_ROWS = 8
"""The ops' largest batch (rows per call) on AVX512-BF16 dot products."""
TILE_ROWS = 16
"""Their largest batch on AMX tiles (a tile's rows)."""


def available() -> bool:
    """Whether the native kernels are loaded and were built with AVX512-BF16."""
    return native.available() and bool(torch.ops.yuebing.fused_decode_available())


def tiles_available() -> bool:
    """Whether the loaded fused ops run packed weights on AMX tiles here (never builds; an
    older build without the op, as `benchmarks/decode_context.py` loads: no)."""
    return available() and hasattr(torch.ops.yuebing, "fused_decode_tiles") \
        and bool(torch.ops.yuebing.fused_decode_tiles())


def _fits(w: torch.Tensor, silu: bool = False) -> bool:
    """Whether ``w`` is packed for the tiles already or can be (`amx_linear.fits`)."""
    return w.dim() == 5 or amx_linear.fits((w.shape[0], w.shape[1]), w.dtype, w.device, silu)


def _packed(w: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """``w`` in the tiles' layout (as given when packed already, e.g. `Linear.amx`'s)."""
    if w.dim() == 5:
        return w
    return amx_linear.pack_silu_pairs(w) if silu else amx_linear.pack(w)


class FusedDecode:
    """The weights of one model's layers as the fused ops read them, and the fused decode."""

    def __init__(self, cfg: ModelConfig, layers: Sequence[tuple[torch.Tensor, ...]],
                 rope: tuple[torch.Tensor, torch.Tensor],
                 head: tuple[torch.Tensor, torch.Tensor] | None, tiles: bool | None = None,
                 max_rows: int | None = None) -> None:
        """``layers``: per layer (ln1, qkv, o, ln2, gate_up, down), the matmul weights row-major
        ``[out, in]``; ``rope``: the cos/sin tables; ``head``: the final norm and the LM head
        ``[vocab, hidden]``, or None (not the last pipeline stage); a matmul weight may come
        packed already (`amx_linear.pack`'s layout, the gate/up one in SiLU pairs: a
        `Linear.amx`, shared). ``tiles``: the layers' weights in the AMX tiles' layout (None:
        where `tiles_available` and every one fits); the LM head takes them where it fits."""
        if tiles is None:
            tiles = tiles_available() and all(
                _fits(qkv) and _fits(o) and _fits(gu, True) and _fits(down)
                for _, qkv, o, _, gu, down in layers)
        self.cfg = cfg
        self.tiles = tiles
        self.layers: list[tuple[torch.Tensor, ...]]
        if tiles:
            self.layers = [(ln1, _packed(qkv), _packed(o), ln2, _packed(gu, True), _packed(down))
                           for ln1, qkv, o, ln2, gu, down in layers]
            if head is not None and _fits(head[1]):
                head = (head[0], _packed(head[1]))
        else:
            self.layers = [tuple(w.contiguous() for w in layer) for layer in layers]
        self.rope = rope
        self.head = head
        self.limit = TILE_ROWS if tiles else MAX_ROWS
        """The ops' largest batch with these weights."""
        self.max_rows = self.limit if max_rows is None else max_rows
        """Decode-only steps of at most this many sequences run fused (0: never)."""

    def share(self, packed: Sequence[tuple[torch.Tensor | None, ...]]) -> None:
        """Per layer (qkv, o, gate_up, down), the same weights packed elsewhere (None: not):
        use those tensors instead of this one's copies (tiles only; the shapes must agree)."""
        assert self.tiles
        for i, ((ln1, qkv, o, ln2, gu, down), theirs) in enumerate(
                zip(self.layers, packed, strict=True)):
            w = [t if t is not None and t.shape == m.shape else m
                 for m, t in zip((qkv, o, gu, down), theirs, strict=True)]
            self.layers[i] = (ln1, w[0], w[1], ln2, w[2], w[3])

    def applies(self, rows: int, meta: AttnMetadata) -> bool:
        return 0 < rows <= self.max_rows and not meta.prefills and meta.slots is not None \
            and meta.decode_table is not None and meta.decode_lens is not None

    def layer(self, i: int, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
              kv: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata,
              first: bool) -> torch.Tensor:
        """Layer ``i`` (local): updates ``residual`` in place, writes the K/V, returns the MLP
        output (added to ``residual`` by the next layer)."""
        cfg = self.cfg
        ln1, wqkv, wo, ln2, wgu, wdown = self.layers[i]
        assert meta.slots is not None and meta.decode_table is not None \
            and meta.decode_lens is not None
        return torch.ops.yuebing.decode_layer(
            x, residual, ln1, wqkv, wo, ln2, wgu, wdown, self.rope[0], self.rope[1], positions,
            kv[0], kv[1], meta.slots, meta.decode_table, meta.decode_lens, cfg.num_heads,
            cfg.num_kv_heads, cfg.rms_norm_eps, cfg.head_dim**-0.5, first)

    def logits(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the rows (final norm of ``residual + x``, then the LM head)."""
        assert self.head is not None
        return torch.ops.yuebing.decode_logits(residual, x, self.head[0], self.head[1],
                                               self.cfg.rms_norm_eps)


OpsLayer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor,
                     tuple[torch.Tensor, torch.Tensor], AttnMetadata], torch.Tensor]
"""Layer 0 op by op: (x, residual, positions, kv, meta) -> MLP output."""


def choose_max_rows(fused: FusedDecode, ops_layer: OpsLayer,
                    kv: tuple[torch.Tensor, torch.Tensor], block_size: int,
                    context: int = 128, rounds: int = 5,
                    rows: Sequence[int] | None = None) -> tuple[int, dict[str, float]]:
    """The largest batch of ``rows`` (default 1, 2, 4, ... up to the ops' limit) up to which
    the fused layer beats the op-by-op one here (0 if it never does), and the timings (median
    seconds, interleaved): layer 0 of a decode step at ``context`` tokens per sequence, over the
    scratch cache ``kv``."""
    cfg = fused.cfg
    if rows is None:
        rows = [b for b in (1, 2, 4, 8, 16) if b <= fused.limit]
    k_cache = kv[0]
    per_seq = context // block_size  # whole blocks: the torch paths need no mask
    timings: dict[str, float] = {}
    best = 0
    for b in rows:
        if b * per_seq > k_cache.shape[0]:
            break
        table = torch.arange(b * per_seq, dtype=torch.int32).view(b, per_seq)
        pos = torch.full((b,), context - 1, dtype=torch.long)
        slots = table[:, -1].long() * block_size + (context - 1) % block_size
        slot_rows = slot_index(table[:, -1].long(), pos % block_size, cfg.num_kv_heads,
                               block_size)
        meta = AttnMetadata(slot_rows, b, head_index(table.long(), cfg.num_kv_heads),
                            per_seq * block_size, None, [], slots=slots, decode_table=table,
                            decode_lens=torch.full((b,), context, dtype=torch.int32))
        x = torch.randn(b, cfg.hidden_size).to(k_cache.dtype)
        res = torch.randn(b, cfg.hidden_size).to(k_cache.dtype)
        fns: dict[str, Callable[[], object]] = {
            "fused": partial(_fused_once, fused, x, res, pos, kv, meta),
            "ops": partial(_ops_once, ops_layer, x, res, pos, kv, meta)}
        med = _interleaved(fns, rounds)
        timings.update({f"b{b}_{k}": v for k, v in med.items()})
        if med["fused"] >= med["ops"]:
            break
        best = b
    return best, timings


def _fused_once(fused: FusedDecode, x: torch.Tensor, res: torch.Tensor, pos: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata) -> torch.Tensor:
    return fused.layer(0, x, res.clone(), pos, kv, meta, False)


def _ops_once(ops_layer: OpsLayer, x: torch.Tensor, res: torch.Tensor, pos: torch.Tensor,
              kv: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata) -> torch.Tensor:
    return ops_layer(x.clone(), res.clone(), pos, kv, meta)


def _interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(rounds):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(4):
                    fn()
                samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) / 4 for k, v in samples.items()}
