"""Engine micro-benchmarks (``yuebing bench engine``).

For each variant (dtype × decode-attention path, `run_variant`) one engine is built over the
same loaded weights and measured side by side in one process: decode step time and tokens/s
per batch size (each sequence holding ``prompt_len`` tokens), prefill tokens/s per prompt
length (time to first token), both also in process CPU time, the paging cost of decode
attention (`paging_cost`: gather through block tables vs contiguous K/V) and KV export/import
throughput for one block and a batch of blocks (`transfer_rates`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from yuebing.engine.attention import DECODE_IMPLS, AttnMetadata, head_index
from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.profile import _Tokens, median_timing, time_decode, time_prefill
from yuebing.engine.weights import LoadedWeights


@dataclass
class VariantResult:
    dtype: str
    attention: str
    threads: int
    decode_ms: dict[int, float] = field(default_factory=dict)
    decode_cpu_ms: dict[int, float] = field(default_factory=dict)
    decode_tok_s: dict[int, float] = field(default_factory=dict)
    prefill_tok_s: dict[int, float] = field(default_factory=dict)
    prefill_cpu_tok_s: dict[int, float] = field(default_factory=dict)
    paging: dict[int, dict[str, float]] = field(default_factory=dict)
    transfer: dict[str, float] = field(default_factory=dict)


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paging_cost(engine: LLMEngine, batch: int, context: int, repeats: int = 5) -> dict[str, float]:
    """Milliseconds of decode attention over all layers: paged gather vs contiguous K/V."""
    mc, pool = engine.model_config, engine.pool
    bs = pool.block_size
    nblk = -(-context // bs)
    if batch * nblk > pool.num_blocks:
        raise ValueError(f"paging bench needs {batch * nblk} blocks, the pool has "
                         f"{pool.num_blocks}")
    table = torch.randperm(pool.num_blocks)[: batch * nblk].view(batch, nblk).to(pool.device)
    meta = AttnMetadata(torch.zeros(0, dtype=torch.long), batch,
                        head_index(table, mc.num_kv_heads), context, None, [],
                        decode_table=table.to(torch.int32),
                        decode_lens=torch.full((batch,), context, dtype=torch.int32,
                                               device=pool.device))
    q = torch.randn(batch, mc.num_heads, mc.head_dim, device=pool.device).to(pool.dtype)
    if engine.model.token_impl is not None:  # batch-invariant: each sequence's token alone
        meta.token_table, meta.token_lens = meta.decode_table, meta.decode_lens
    impl = engine.model.token_impl or DECODE_IMPLS[engine.attention]
    scale = mc.head_dim**-0.5

    def paged() -> None:
        for k_cache, v_cache in pool.layers:
            impl(q, k_cache, v_cache, meta, scale)

    kvh, hd = mc.num_kv_heads, mc.head_dim
    contig = [(torch.randn(batch * kvh, context, hd, device=pool.device).to(pool.dtype),
               torch.randn(batch * kvh, context, hd, device=pool.device).to(pool.dtype))
              for _ in range(mc.num_layers)]

    def contiguous() -> None:
        qg = q.view(batch * kvh, -1, hd)
        for k, v in contig:
            s = torch.bmm(qg, k.transpose(1, 2)).float().mul_(scale)
            torch.bmm(torch.softmax(s, -1).to(q.dtype), v)

    return {"paged_ms": 1e3 * _best(paged, repeats),
            "contiguous_ms": 1e3 * _best(contiguous, repeats)}


def transfer_rates(engine: LLMEngine, nblocks: int = 64, repeats: int = 5) -> dict[str, float]:
    """GB/s of export (pool → contiguous buffer) and import, for 1 block and ``nblocks``."""
    pool = engine.pool
    n = min(nblocks, pool.num_blocks)
    ids = torch.randperm(pool.num_blocks)[:n].tolist()
    out: dict[str, float] = {"block_bytes": float(pool.block_nbytes)}
    for label, blocks in (("1", ids[:1]), (str(n), ids)):
        buf = pool.export_blocks(blocks)
        gb = len(blocks) * pool.block_nbytes / 1e9
        out[f"export_{label}_GBps"] = gb / _best(partial(pool.export_blocks, blocks, buf),
                                                 repeats)
        out[f"import_{label}_GBps"] = gb / _best(partial(pool.import_blocks, blocks, buf),
                                                 repeats)
    return out


def run_variant(weights: LoadedWeights, base: EngineConfig, variant: tuple[str, str, int],
                batches: list[int], prompt_len: int, prefill_lens: list[int],
                progress: Callable[[str], None], steps: int = 16) -> VariantResult:
    """Measure one (dtype, attention, threads) variant; threads 0 = the engine's choice.
    Attention ``invariant`` is batch-invariant mode; any other name turns that mode off."""
    dtype, attention, threads = variant
    invariant = attention == "invariant"
    cfg = EngineConfig(**{**base.__dict__, "dtype": dtype, "batch_invariant": invariant,
                          "attention": "auto" if invariant else attention,
                          "prefill_attention": "same" if invariant else base.prefill_attention,
                          "threads": threads or base.threads,
                          "max_num_seqs": max(batches + [base.max_num_seqs]),
                          "max_batch_tokens": max(prefill_lens + [base.max_batch_tokens])})
    engine = LLMEngine(cfg, weights=weights)
    res = VariantResult(str(engine.dtype).removeprefix("torch."), engine.attention,
                        torch.get_num_threads())
    tokens = _Tokens(engine.model_config.vocab_size, seed=1)
    engine.warmup()
    for b in batches:
        progress(f"{res.dtype}/{res.attention}/{res.threads}t: decode batch {b}")
        t = time_decode(engine, b, b * prompt_len, tokens, steps)
        res.decode_ms[b], res.decode_cpu_ms[b] = 1e3 * t.wall, 1e3 * t.cpu
        res.decode_tok_s[b] = b / t.wall
    for n in prefill_lens:
        progress(f"{res.dtype}/{res.attention}: prefill {n}")
        t = median_timing(time_prefill(engine, n, 0, tokens) for _ in range(3))
        res.prefill_tok_s[n], res.prefill_cpu_tok_s[n] = n / t.wall, n / t.cpu
    for b in batches:
        progress(f"{res.dtype}/{res.attention}: paging batch {b}")
        res.paging[b] = {**paging_cost(engine, b, prompt_len), "step_ms": res.decode_ms[b]}
    progress(f"{res.dtype}/{res.attention}: export/import")
    res.transfer = transfer_rates(engine)
    return res
