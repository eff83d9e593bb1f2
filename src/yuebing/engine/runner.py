"""Model runner: turns a `StepPlan` into the flat tensors of one forward pass.

Called by the engine once per step. Decoding sequences come first (one token each), then each
prefill chunk; for every token it computes the KV slot (block, offset) from the sequence's
block table, builds the decode gather index / padding mask and per-chunk causal masks (in
batch-invariant mode also every token's own block table and context length), runs
`LlamaModel.forward` and returns the logits of the sequences that produce a token this step
(every decode, and prefills whose chunk reaches the end of their tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yuebing.engine.attention import (
    AttnMetadata,
    PrefillSlice,
    causal_mask,
    head_index,
    slot_index,
)
from yuebing.engine.kv_cache import KVPool
from yuebing.engine.model import Boundary, LlamaModel
from yuebing.engine.scheduler import StepPlan
from yuebing.engine.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttnMetadata
    logits_rows: torch.Tensor
    sampled: list[Sequence]
    boundary: Boundary | None = None
    """A later pipeline stage's input rows (the previous stage's output), in batch order."""


class ModelRunner:
    """Executes steps of one model over one KV pool."""

    def __init__(self, model: LlamaModel, pool: KVPool, per_token: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.device = model.device
        self.block_size = pool.block_size
        self.per_token = per_token
        """Batch-invariant mode: also fill ``AttnMetadata.token_table`` / ``token_lens``."""

    def prepare(self, plan: StepPlan) -> StepInputs:
        bs, kvh, dev = self.block_size, self.pool.num_kv_heads, self.device
        ids = [seq.all_ids[seq.num_computed] for seq in plan.decodes]
        pos = [seq.num_computed for seq in plan.decodes]
        positions = [torch.as_tensor(pos, dtype=torch.long)]
        blocks_t = [torch.as_tensor([seq.blocks[p // bs] for seq, p in zip(plan.decodes, pos,
                                                                          strict=True)],
                                    dtype=torch.long)]
        rows = list(range(len(plan.decodes)))
        sampled = list(plan.decodes)
        lens = [p + 1 for p in pos]
        decode_index, max_len, bias, decode_table = self._decode_meta(plan, lens)
        slices: list[PrefillSlice] = []
        start = len(plan.decodes)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for seq, n in plan.prefills:
            nc = seq.num_computed
            ids.extend(seq.all_ids[nc:nc + n])
            if seq.stage_input is not None:
                staged.append(seq.stage_input.rows(nc, n))
            p = torch.arange(nc, nc + n)
            positions.append(p)
            table = torch.as_tensor(seq.blocks[: -(-(nc + n) // bs)], dtype=torch.long)
            blocks_t.append(table[p // bs])
            table = table.to(dev)
            slices.append(PrefillSlice(start, n, nc + n, head_index(table, kvh),
                                       causal_mask(n, nc + n, dev), table))
            if nc + n == seq.num_tokens and self.model.is_last:
                rows.append(start + n - 1)
                sampled.append(seq)
            start += n
        all_pos = torch.cat(positions)
        all_blocks = torch.cat(blocks_t)
        slots = slot_index(all_blocks, all_pos % bs, kvh, bs).to(dev)
        meta = AttnMetadata(slots, len(plan.decodes), decode_index, max_len, bias, slices,
                            slots=(all_blocks * bs + all_pos % bs).to(dev),
                            decode_table=None if decode_table is None else decode_table.to(dev),
                            decode_lens=torch.as_tensor(lens, dtype=torch.int32).to(dev))
        if self.per_token:
            meta.token_table, meta.token_lens = self._token_meta(plan, len(ids))
        boundary = None
        if not self.model.is_first:
            if plan.decodes or len(staged) != len(plan.prefills):
                raise RuntimeError("a later pipeline stage runs only staged prefills")
            boundary = Boundary(torch.cat([r for r, _ in staged]).to(dev),
                                torch.cat([x for _, x in staged]).to(dev))
        return StepInputs(torch.as_tensor(ids, dtype=torch.long).to(dev), all_pos.to(dev), meta,
                          torch.as_tensor(rows, dtype=torch.long).to(dev), sampled, boundary)

    def _decode_meta(self, plan: StepPlan, lens: list[int]) -> tuple[
            torch.Tensor | None, int, torch.Tensor | None, torch.Tensor | None]:
        """Gather index over whole blocks, padded length, tail mask and int32 block table
        ``[D, max_blocks]`` (zero-padded) of the decodes.

        Attention runs over whole gathered blocks (bmm on contiguous operands beat a sliced
        view in our micro-benchmarks); the mask hides keys past each sequence's context.
        """
        if not lens:
            return None, 0, None, None
        bs, dev = self.block_size, self.device
        max_blocks = -(-max(lens) // bs)
        max_len = max_blocks * bs
        table = torch.zeros(len(lens), max_blocks, dtype=torch.long)
        for r, seq in enumerate(plan.decodes):
            nb = -(-lens[r] // bs)
            table[r, :nb] = torch.as_tensor(seq.blocks[:nb])
        index = head_index(table, self.pool.num_kv_heads).to(dev)
        bias = None
        if min(lens) != max_len:
            ar = torch.arange(max_len)
            bias = torch.where(ar[None, :] < torch.as_tensor(lens)[:, None], 0.0,
                               float("-inf"))[:, None, :].to(dev)
        return index, max_len, bias, table.to(torch.int32)

    def _token_meta(self, plan: StepPlan, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 block table ``[T, max_blocks]`` (zero-padded) and context length ``[T]`` of
        every token of the step, in the flat batch's order (decodes, then each chunk)."""
        bs = self.block_size
        spans: list[tuple[list[int], int]] = []  # (blocks of the context, tokens sharing it)
        lens: list[int] = []
        for seq in plan.decodes:
            ctx = seq.num_computed + 1
            spans.append((seq.blocks[: -(-ctx // bs)], 1))
            lens.append(ctx)
        for seq, n in plan.prefills:
            nc = seq.num_computed
            spans.append((seq.blocks[: -(-(nc + n) // bs)], n))
            lens.extend(range(nc + 1, nc + n + 1))
        table = torch.zeros(num_tokens, max(len(b) for b, _ in spans), dtype=torch.int32)
        row = 0
        for blocks, count in spans:
            table[row:row + count, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.int32)
            row += count
        return table.to(self.device), torch.as_tensor(lens, dtype=torch.int32).to(self.device)

    def run(self, plan: StepPlan) -> tuple[torch.Tensor | Boundary, list[Sequence]]:
        """Forward pass of ``plan``; returns (logits of sampled rows, their sequences), or on
        a pipeline stage before the last (every row's `Boundary`, no sequences)."""
        inputs = self.prepare(plan)
        out = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta,
                                 self.pool.layers, inputs.logits_rows, inputs.boundary)
        return out, inputs.sampled
