"""LLaMA-family decoder in plain torch (Llama, SmolLM, Qwen2): `LlamaModel`.

RMSNorm, RoPE (with llama3 / linear scaling), grouped-query attention over the paged KV pool,
SwiGLU, tied embeddings. Built once per engine from a `LoadedWeights`: Q/K/V and gate/up are
fused so a layer is four matmuls, and on CPU in bf16/fp16 every matmul weight is packed once
into oneDNN's blocked layout (`yuebing.engine.linear`). The model runner calls `forward` once
per step; after each layer's K/V is written it calls the layer hooks (so a prefill instance
ships layer i while layer i+1 computes). The small ops (add + norm, RoPE with the KV write,
SiLU·mul) go through ``self.ops``, a `yuebing.engine.kernels.KernelOps` (torch or native C++);
where the engine routes prefill rows to the native AMX linear, gate/up and SiLU·mul are one call.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from yuebing.engine.attention import DECODE_IMPLS, PREFILL_IMPLS, AttnMetadata
from yuebing.engine.config import ModelConfig, RopeScaling
from yuebing.engine.fused_decode import FusedDecode
from yuebing.engine.kernels import KernelOps, TorchOps
from yuebing.engine.linear import (
    ROUTE_POINTS,
    Linear,
    amx_key,
    can_pack,
    invariant_min_rows,
    plain_ranges,
    shape_key,
)

log = logging.getLogger(__name__)

LayerHook = Callable[[int, AttnMetadata], None]


class Boundary(NamedTuple):
    """The residual stream between two pipeline stages, one row per token of the flat batch:
    the residual sum so far and the last layer's MLP output, not yet added (the next layer's
    fused add + norm adds them, as in one model, so a pipeline computes the same bits)."""

    residual: torch.Tensor
    x: torch.Tensor


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies (float32) with the configured scaling, as Hugging Face computes them."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc: RopeScaling = cfg.rope_scaling
    if freq_factors is not None:
        return inv / freq_factors.float()
    if sc.kind == "linear":
        return inv / sc.factor
    if sc.kind == "llama3":
        low_wavelen = sc.original_max_position / sc.low_freq_factor
        high_wavelen = sc.original_max_position / sc.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
        smooth = (sc.original_max_position / wavelen - sc.low_freq_factor) / (
            sc.high_freq_factor - sc.low_freq_factor)
        smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class _Layer(NamedTuple):
    """One decoder layer's norms and (fused) projections."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


class LlamaModel:
    """Weights on one device in one dtype, and the forward pass over a paged KV pool."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, pack_weights: bool = True,
                 layers: tuple[int, int] | None = None) -> None:
        """``layers``: hold and run only layers [A, B) (a pipeline stage); the first stage
        holds the embedding, the last the final norm and LM head."""
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.first_layer, self.end_layer = layers or (0, cfg.num_layers)
        self.is_first = self.first_layer == 0
        self.is_last = self.end_layer == cfg.num_layers
        self.hooks: list[LayerHook] = []
        self.ops: KernelOps = TorchOps()
        """Per-layer small ops (the engine sets the native ones, see `yuebing.engine.kernels`)."""
        self.decode_impl = DECODE_IMPLS["grouped"]
        self.prefill_impl = PREFILL_IMPLS["sdpa"]
        self.token_impl: Callable[..., torch.Tensor] | None = None
        """Batch-invariant mode: one attention for every token (`attention.TOKEN_IMPLS`),
        used instead of the decode/prefill paths when set."""
        self._scale = cfg.head_dim**-0.5
        self.fused: FusedDecode | None = None
        """Small decode-only steps run fused (`yuebing.engine.fused_decode`), set by the
        engine with `use_fused`."""
        self._plain: list[tuple[torch.Tensor, ...]] = []
        """Row-major (qkv, o, gate_up, down) weights of each layer, kept from load until the
        engine decides on the matmul routes and the fused decode (`use_plain_routes`,
        `use_fused`)."""
        self._plain_head: torch.Tensor | None = None

        def take(name: str) -> torch.Tensor:
            try:
                t = tensors[name]
            except KeyError:
                raise KeyError(f"weights lack tensor {name}") from None
            return t.to(device=device, dtype=dtype).contiguous()

        pack = pack_weights and can_pack(dtype, device)

        def lin(w: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(w.to(device=device, dtype=dtype).contiguous(),
                          None if bias is None else bias.to(device=device, dtype=dtype), pack)

        embed = take("model.embed_tokens.weight") \
            if self.is_first or (self.is_last and cfg.tie_embeddings) else None
        self.embed = embed if self.is_first else None
        self.lm_head: Linear | None = None
        self.norm: torch.Tensor | None = None
        if self.is_last:  # tied weights: the LM head's (packed) copy of the embedding
            head = embed if embed is not None and cfg.tie_embeddings else take("lm_head.weight")
            self.lm_head = lin(head)
            self._plain_head = head
            self.norm = take("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(self.first_layer, self.end_layer):
            p = f"model.layers.{i}."
            qkv = torch.cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([tensors[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            gate_up = torch.cat([tensors[p + "mlp.gate_proj.weight"],
                                 tensors[p + "mlp.up_proj.weight"]])
            o, down = take(p + "self_attn.o_proj.weight"), take(p + "mlp.down_proj.weight")
            qkv, gate_up = qkv.to(device=device, dtype=dtype), gate_up.to(device=device, dtype=dtype)
            self.layers.append(_Layer(
                take(p + "input_layernorm.weight"), take(p + "post_attention_layernorm.weight"),
                lin(qkv, bias), lin(o), lin(gate_up), lin(down)))
            self._plain.append((qkv, o, gate_up, down))
        self.packed = pack and self.layers[0].qkv.is_packed
        """Whether the matmul weights are oneDNN-packed (see `yuebing.engine.linear`)."""
        inv = rope_inv_freq(cfg, tensors.get("rope_freqs"))
        pos = torch.arange(cfg.max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        self.rope_cos = freqs.cos().to(device=device, dtype=dtype)
        self.rope_sin = freqs.sin().to(device=device, dtype=dtype)
        """RoPE tables ``[max_position, head_dim/2]`` in the model's dtype."""

    def fused_candidate(self) -> FusedDecode | None:
        """The fused decode over the kept plain weights (max_rows unset), or None where it
        cannot run: no plain weights (a QKV bias), not bf16 on CPU."""
        if not self._plain or self.cfg.qkv_bias or self.dtype != torch.bfloat16 \
                or self.device.type != "cpu":
            return None
        layers = [(lay.ln1, qkv, o, lay.ln2, gu, down)
                  for lay, (qkv, o, gu, down) in zip(self.layers, self._plain, strict=True)]
        head = None if self._plain_head is None or self.norm is None \
            else (self.norm, self._plain_head)
        return FusedDecode(self.cfg, layers, (self.rope_cos, self.rope_sin), head)

    def plain_matmuls(self) -> list[tuple[Linear, torch.Tensor]]:
        """Each layer's projections with their row-major weights (empty once dropped)."""
        return [(lin, w) for lay, ws in zip(self.layers, self._plain, strict=False)
                for lin, w in zip((lay.qkv, lay.o, lay.gate_up, lay.down), ws, strict=True)]

    def use_plain_routes(self, plain: dict[str, list[int]]) -> str:
        """Route each projection's row counts that `linear.choose_routes` found faster on the
        row-major weight there (``plain``: shape → points); returns the routes as the
        engine's signature names them (``""``: none). Call before `use_fused`."""
        for lin, w in self.plain_matmuls():
            chosen = plain.get(shape_key(lin), [])
            lin.use_plain(w, plain_ranges(ROUTE_POINTS, chosen))
        return ";".join(f"{k}@{','.join(map(str, sorted(v)))}" for k, v in sorted(plain.items())
                        if v)

    def amx_matmuls(self) -> list[tuple[Linear, torch.Tensor, bool]]:
        """`plain_matmuls` with whether each is the fused gate/up projection (the AMX kernel
        fuses its SiLU·mul; `linear.choose_amx`)."""
        return [(lin, w, lin is lay.gate_up) for lay, ws in zip(self.layers, self._plain,
                                                                 strict=False)
                for lin, w in zip((lay.qkv, lay.o, lay.gate_up, lay.down), ws, strict=True)]

    def use_amx(self, chosen: dict[str, list[int]]) -> str:
        """Route each projection's row counts that `linear.choose_amx` found faster on the
        native AMX kernel (``chosen``: `linear.amx_key` → points; the weights are packed into
        tiles here); returns the routes as the engine's signature names them (``""``: none).
        Call before `use_fused`."""
        for lin, w, silu in self.amx_matmuls():
            lin.use_amx(w, plain_ranges(ROUTE_POINTS, chosen.get(amx_key(lin, silu), [])), silu)
        return ";".join(f"{k}@{','.join(map(str, sorted(v)))}" for k, v in sorted(chosen.items())
                        if v)

    def use_fused(self, fused: FusedDecode | None) -> None:
        """Run small decode steps through ``fused`` (None: never); drops the plain weights
        when unused (the fused decode holds its own references). A projection the AMX linear
        holds packed (`use_amx`) and the fused decode on tiles share that one copy."""
        self.fused = fused
        self._plain, self._plain_head = [], None
        if fused is not None and fused.tiles:
            fused.share([(lay.qkv.amx, lay.o.amx, lay.gate_up.amx, lay.down.amx)
                         for lay in self.layers])

    def make_matmuls_invariant(self) -> int | None:
        """Pad every matmul's input to the row count from which this CPU's kernels give each
        row the same bits at any batch size (`yuebing.engine.linear.invariant_min_rows`).
        Called by the engine in batch-invariant mode; returns that row count, or None (and
        leaves the matmuls as they are) where no candidate holds."""
        linears = [*([self.lm_head] if self.lm_head is not None else []),
                   *(lin for layer in self.layers
                     for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))]
        rows = invariant_min_rows(linears)
        if rows is None:
            log.warning("batch invariance: this CPU's %s matmuls depend on the batch size at "
                        "any padding; outputs may depend on the batch", self.dtype)
        for lin in linears:
            lin.min_rows = rows or 1
        return rows

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                logits_rows: torch.Tensor, boundary: Boundary | None = None
                ) -> torch.Tensor | Boundary:
        """Run this model's layers on the flat batch (``kv[i]``: local layer i's cache; hooks
        get the model's layer number). The first stage embeds ``input_ids``, a later one starts
        from the previous stage's ``boundary``. The last stage returns float32 logits of
        ``logits_rows``, any other the `Boundary` of every row."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        fused = self.fused if self.fused is not None and self.token_impl is None \
            and self.fused.applies(positions.shape[0], meta) else None
        rope = None if fused is not None else ops.prepare_rope(positions, self.rope_cos,
                                                               self.rope_sin)
        if self.embed is not None:
            residual = F.embedding(input_ids, self.embed)
            x = residual  # reassigned by every layer: its MLP output, added by the next norm
        elif boundary is None:
            raise ValueError(f"layers {self.first_layer}:{self.end_layer} start from the "
                             "previous stage's boundary, and none was given")
        else:
            residual, x = boundary
        if fused is not None:  # the fused op updates the residual in place
            residual, x = residual.contiguous(), x.contiguous()
        for i in range(len(self.layers)):
            first = i == 0 and self.is_first
            if fused is not None:
                x = fused.layer(i, x, residual, positions, kv[i], meta, first)
                for hook in self.hooks:
                    hook(self.first_layer + i, meta)
            else:
                x, residual = self._layer(i, x, residual, rope, kv[i], meta, first)
        if self.lm_head is None or self.norm is None:
            return Boundary(residual, x)
        head = self.fused if self.fused is not None and self.token_impl is None \
            and 0 < logits_rows.shape[0] <= self.fused.limit else None
        if head is not None and head.head is not None:
            # a few rows (decode, a prefill's last token): one pass over the LM head at memory
            # speed; oneDNN's packed GEMM at so few rows reads it several times slower
            return head.logits(residual.index_select(0, logits_rows),
                               x.index_select(0, logits_rows))
        last = residual.index_select(0, logits_rows) + x.index_select(0, logits_rows)
        return self.lm_head(ops.rms_norm(last, self.norm, eps)).float()

    def _layer(self, i: int, x: torch.Tensor, residual: torch.Tensor, rope: object,
               kv: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata,
               first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Local layer ``i`` op by op: returns (MLP output, residual); calls the hooks after
        the K/V write."""
        cfg, ops, layer = self.cfg, self.ops, self.layers[i]
        h, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        n = residual.shape[0]
        if first:
            hidden = ops.rms_norm(residual, layer.ln1, eps)
        else:  # residual += previous MLP output, fused with the norm
            hidden, residual = ops.add_rms_norm(x, residual, layer.ln1, eps)
        k_cache, v_cache = kv
        q = ops.rope_write_kv(layer.qkv(hidden), rope, k_cache, v_cache, meta, h, kvh)
        for hook in self.hooks:
            hook(self.first_layer + i, meta)
        attn = self._attention(q, k_cache, v_cache, meta)
        hidden, residual = ops.add_rms_norm(layer.o(attn.reshape(n, h * hd)), residual,
                                            layer.ln2, eps)
        return layer.down(layer.gate_up.silu_mul(hidden, ops)), residual

    def first_layer_ops(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                        kv: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata) -> torch.Tensor:
        """Local layer 0 op by op as a step runs it, rope tables included (what
        `fused_decode.choose_max_rows` times the fused layer against)."""
        rope = self.ops.prepare_rope(positions, self.rope_cos, self.rope_sin)
        return self._layer(0, x, residual, rope, kv, meta, False)[0]

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttnMetadata) -> torch.Tensor:
        # q is a strided view of the fused QKV output; decode paths take it as it is
        if self.token_impl is not None:
            return self.token_impl(q, k_cache, v_cache, meta, self._scale)
        if not meta.prefills:
            return self.decode_impl(q, k_cache, v_cache, meta, self._scale)
        if not meta.num_decode and len(meta.prefills) == 1 and meta.prefills[0].start == 0 \
                and meta.prefills[0].length == q.shape[0]:  # one prefill alone: no copy
            return self.prefill_impl(q, k_cache, v_cache, meta.prefills[0], self._scale)
        out = torch.empty_like(q)
        d = meta.num_decode
        if d:
            out[:d] = self.decode_impl(q[:d], k_cache, v_cache, meta, self._scale)
        for sl in meta.prefills:
            out[sl.start:sl.start + sl.length] = self.prefill_impl(
                q[sl.start:sl.start + sl.length], k_cache, v_cache, sl, self._scale)
        return out
