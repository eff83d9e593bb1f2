"""`KvLayout`: how a vLLM instance's paged KV maps to yuebing store objects, and the fingerprint
that names it in the store's keys.

vLLM's CPU attention keeps each layer's KV as `LAYOUT_LBHNC`. A store block of
``store_block_tokens`` tokens is ``store_block_tokens / block_tokens`` vLLM blocks of every
layer, kept as ONE store object laid out ``[layer][vLLM block][kv_heads, block_tokens,
2 * head_size]`` and named by `yuebing.instance.kvkeys.store_key` with the `fingerprint`
(model, dtype, layout, geometry, both block sizes: a mismatch is a miss, never wrong KV). The
connector's scheduler and worker halves build one each from vLLM's config.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from yuebing.core.config import require
from yuebing.core.ids import BlockHash
from yuebing.instance.kvkeys import store_block_keys, store_key

LAYOUT_LBHNC = "LBHNC"
"""Per layer ``[block, kv head, token in block, K|V x head dim]`` (vLLM's CPU attention)."""

_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def model_id(name: str) -> str:
    """A model path or name as it goes into a fingerprint: its last path part, characters other
    than letters, digits and ``._-`` replaced by ``-``."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return _UNSAFE.sub("-", base) or "model"


@dataclass(frozen=True)
class KvLayout:
    """The KV geometry of one vLLM instance (one tensor-parallel rank: TP 1 here)."""

    model: str
    dtype: str
    layers: int
    kv_heads: int
    head_size: int
    block_tokens: int
    """vLLM's ``--block-size`` (tokens per paged block)."""
    store_block_tokens: int
    """Tokens per store object; a multiple of ``block_tokens``."""
    layout: str = LAYOUT_LBHNC

    def __post_init__(self) -> None:
        require(bool(self.model), "a model id is required in the KV fingerprint")
        require(self.dtype in _ELEMENT_BYTES, f"KV dtype {self.dtype!r} is not one of "
                f"{', '.join(_ELEMENT_BYTES)}")
        require(min(self.layers, self.kv_heads, self.head_size, self.block_tokens) > 0,
                f"layers, kv_heads, head_size and block_tokens must be > 0, got {self}")
        require(self.layout == LAYOUT_LBHNC, f"KV layout {self.layout!r} is not supported "
                f"(supported: {LAYOUT_LBHNC})")
        require(self.store_block_tokens > 0 and self.store_block_tokens % self.block_tokens == 0,
                f"the store block ({self.store_block_tokens} tokens) must be a positive multiple "
                f"of vLLM's --block-size ({self.block_tokens}); pick --block-size to divide it")

    @property
    def blocks_per_object(self) -> int:
        """vLLM blocks in one store object (per layer)."""
        return self.store_block_tokens // self.block_tokens

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One vLLM block of one layer: ``(kv_heads, block_tokens, 2 * head_size)``."""
        return (self.kv_heads, self.block_tokens, 2 * self.head_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one vLLM block of one layer."""
        h, n, c = self.block_shape
        return h * n * c * self.element_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer in a store object."""
        return self.blocks_per_object * self.block_bytes

    @property
    def object_bytes(self) -> int:
        """Bytes of one store object (every layer of one store block)."""
        return self.layers * self.layer_bytes

    def fingerprint(self) -> str:
        """What makes this instance's KV bytes differ from another's, as a store-key part."""
        return (f"vllm-{self.model}-{self.dtype}-{self.layout}-l{self.layers}h{self.kv_heads}"
                f"d{self.head_size}-b{self.block_tokens}-s{self.store_block_tokens}")

    def block_keys(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The chained block keys of every full store block of ``token_ids`` (the Conductor's
        KV index speaks these)."""
        return store_block_keys(token_ids, self.store_block_tokens, self.fingerprint())

    def store_keys(self, token_ids: Sequence[int]) -> list[str]:
        """The store keys of every full store block of ``token_ids``."""
        fp = self.fingerprint()
        return [store_key(fp, k) for k in self.block_keys(token_ids)]

    def check_tensor_shape(self, name: str, shape: Sequence[int]) -> None:
        """Refuse a paged KV tensor whose per-block shape is not this layout's (ValueError
        naming both)."""
        if tuple(shape[1:]) != self.block_shape:
            raise ValueError(f"vLLM's KV tensor {name} has blocks of shape {tuple(shape[1:])}, "
                             f"the yuebing connector expects {self.block_shape} "
                             f"({self.layout}, {self.fingerprint()})")


def layout_from_hf(config: dict[str, object], model: str, dtype: str, block_tokens: int,
                   store_block_tokens: int) -> KvLayout:
    """The layout vLLM gives a LLaMA-family model from its HF ``config.json`` (what the
    connector inside vLLM computes from vLLM's config, for the side that has no vLLM)."""
    def num(key: str, default: object = None) -> int:
        value = config.get(key, default)
        if not isinstance(value, int):
            raise ValueError(f"the model's config.json has no integer {key!r}")
        return value
    heads = num("num_attention_heads")
    head_size = config.get("head_dim") or num("hidden_size") // heads
    assert isinstance(head_size, int)
    return KvLayout(model=model_id(model), dtype=dtype, layers=num("num_hidden_layers"),
                    kv_heads=num("num_key_value_heads", heads), head_size=head_size,
                    block_tokens=block_tokens, store_block_tokens=store_block_tokens)


def check_expected(layout: KvLayout, model: str | None, block_tokens: int | None) -> None:
    """Refuse an instance whose model or block size is not the one the Conductor expects
    (ValueError naming both); None expects nothing."""
    if model and model_id(model) != layout.model:
        raise ValueError(f"the vLLM instance serves model {layout.model!r}, yuebing expects "
                         f"{model_id(model)!r}")
    if block_tokens and block_tokens != layout.block_tokens:
        raise ValueError(f"the vLLM instance has --block-size {layout.block_tokens}, yuebing "
                         f"expects {block_tokens}")
