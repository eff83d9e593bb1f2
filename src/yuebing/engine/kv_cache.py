"""The KV pool: `KVPool`, one preallocated tensor holding every block's K and V for every layer.

Layout ``[layers, 2 (K/V), blocks, kv_heads, block_size, head_dim]``: each layer's K (and V) is
a contiguous ``[blocks, kv_heads, block_size, head_dim]`` tensor, so decode attention gathers a
batch's context with a single ``index_select`` straight into the matmul layout. The engine owns
the pool; the block allocator decides which block ids are in use. To move KV between engines:
`layer_view` / `export_layer` (one layer of a run of blocks; zero-copy when the blocks are
consecutive), `export_blocks` (whole blocks as one contiguous buffer, the unit the store keeps)
and `import_blocks` / `import_layer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from yuebing.core.errors import ConfigError, EngineError
from yuebing.engine.config import MAX_BLOCKS, ModelConfig
from yuebing.engine.runtime import advise_hugepages


class KVPool:
    """Preallocated paged K/V storage for all layers."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, storage: torch.Tensor | None = None) -> None:
        """``storage``: optional flat uint8 CPU tensor of exactly `bytes_per_block` ×
        ``num_blocks`` bytes to hold the pool (e.g. a transfer-engine shared-memory segment, so
        peers write KV straight into it); by default the pool allocates its own memory."""
        self.num_layers = cfg.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.dtype, self.device = dtype, device
        shape = (cfg.num_layers, 2, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        if num_blocks > MAX_BLOCKS:
            raise ConfigError(f"a KV pool of {num_blocks} blocks is past the {MAX_BLOCKS} that "
                              "int32 block tables address; lower kv_cache_bytes / num_blocks")
        if storage is None:
            try:
                self.data = torch.empty(shape, dtype=dtype, device=device)
            except (RuntimeError, MemoryError) as e:  # out of memory, size overflow
                gib = num_blocks * self.bytes_per_block(cfg, block_size, dtype) / 2**30
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConfigError(f"cannot allocate a KV pool of {num_blocks} blocks "
                                  f"({gib:,.1f} GiB) on {device.type}: {first}; lower "
                                  "kv_cache_bytes / num_blocks") from None
            self.huge_pages = advise_hugepages(self.data)  # before the first touch (zero_)
        else:
            need = num_blocks * self.bytes_per_block(cfg, block_size, dtype)
            if storage.dtype != torch.uint8 or storage.numel() != need or device.type != "cpu":
                raise EngineError(f"KV storage must be a CPU uint8 tensor of {need} bytes, got "
                                  f"{storage.dtype} × {storage.numel()} on {device.type}")
            self.data = storage.view(dtype).view(shape)
            self.huge_pages = False
        self.data.zero_()
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(cfg.num_layers)]

    @property
    def _chunk(self) -> int:
        return self.num_kv_heads * self.block_size * self.head_dim

    def _by_block(self) -> torch.Tensor:
        """The pool as ``[layers·2, blocks, kv_heads·bs·hd]`` (a view)."""
        return self.data.view(self.num_layers * 2, self.num_blocks, self._chunk)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return cfg.num_layers * 2 * cfg.num_kv_heads * block_size * cfg.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one block of one layer's K (or V): the unit of a layer-wise transfer."""
        return self._chunk * self.data.element_size()

    def byte_offset(self, layer: int, kv: int, block: int) -> int:
        """Offset of (layer, K/V, block) in the pool's bytes (layout in the module docstring)."""
        return ((layer * 2 + kv) * self.num_blocks + block) * self.chunk_nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers (the export unit)."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def _ids(self, blocks: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(blocks), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise EngineError(f"block ids {list(blocks)} out of range 0..{self.num_blocks - 1}")
        return ids.to(self.device)

    @staticmethod
    def _run(blocks: Sequence[int]) -> slice | None:
        """``slice(a, b)`` if ``blocks`` are consecutive ids a, a+1, ..., b-1."""
        if blocks and all(b == blocks[0] + i for i, b in enumerate(blocks)):
            return slice(blocks[0], blocks[0] + len(blocks))
        return None

    def layer_view(self, layer: int, blocks: Sequence[int]) -> torch.Tensor | None:
        """Zero-copy ``[2, n, kv_heads, bs, hd]`` of consecutive ``blocks`` in one layer."""
        run = self._run(list(blocks))
        return None if run is None else self.data[layer, :, run]

    def export_layer(self, layer: int, blocks: Sequence[int]) -> torch.Tensor:
        """``[2, n, kv_heads, bs, hd]`` of one layer: a view if consecutive, else a copy."""
        view = self.layer_view(layer, blocks)
        return view if view is not None else self.data[layer].index_select(1, self._ids(blocks))

    def import_layer(self, layer: int, blocks: Sequence[int], buf: torch.Tensor) -> None:
        """Write ``buf [2, n, kv_heads, bs, hd]`` into one layer of ``blocks``."""
        expect = (2, len(blocks), self.num_kv_heads, self.block_size, self.head_dim)
        if tuple(buf.shape) != expect:
            raise EngineError(f"layer KV buffer has shape {tuple(buf.shape)}, expected {expect}")
        self.data[layer].index_copy_(1, self._ids(blocks), buf.to(self.device, self.dtype))

    def export_blocks(self, blocks: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Whole blocks as one contiguous ``[n, layers, 2, kv_heads, bs, hd]`` buffer."""
        ids = self._ids(blocks)
        if out is None:
            out = torch.empty((len(blocks), *self.block_shape), dtype=self.dtype,
                              device=self.device)
        elif tuple(out.shape) != (len(blocks), *self.block_shape) or not out.is_contiguous():
            raise EngineError("export buffer must be contiguous with shape "
                              f"{(len(blocks), *self.block_shape)}")
        # one strided copy per block ([layers·2] runs of kv_heads·bs·hd elements): faster in
        # our micro-benchmarks than gathering all blocks and permuting the result
        src, dst = self._by_block(), out.view(len(blocks), -1, self._chunk)
        for i, b in enumerate(ids.tolist()):
            dst[i].copy_(src[:, b])
        return out

    def import_blocks(self, blocks: Sequence[int], buf: torch.Tensor) -> None:
        """Write whole-block buffers (as from `export_blocks`) into ``blocks``."""
        expect = (len(blocks), *self.block_shape)
        if tuple(buf.shape) != expect:
            raise EngineError(f"KV buffer has shape {tuple(buf.shape)}, expected {expect}")
        ids = self._ids(blocks).tolist()
        src = buf.to(self.device, self.dtype).reshape(len(blocks), -1, self._chunk)
        dst = self._by_block()
        for i, b in enumerate(ids):
            dst[:, b].copy_(src[i])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` (all layers, K and V) into block ``dst`` (copy on write of a
        forked sequence's partly filled last block)."""
        by_block = self._by_block()
        by_block[:, dst].copy_(by_block[:, src])

    def zero_(self) -> None:
        self.data.zero_()
