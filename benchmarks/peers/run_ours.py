"""Peer: OUR engine (``yuebing.engine.LLMEngine``), driven through its Python API.

Runs in the project venv as a subprocess of ``benchmarks/engine_peers.py``; see workload.py for
the method. The engine is configured like the vLLM peer: same dtype, threads, KV space, token
budget per step and batch limit, prefix caching off. ``--model`` is anything the engine accepts
(default ``smollm2``: the bundled GGUF the HF export was made from, so the weights are the same).
"""

from __future__ import annotations

import sys
from typing import Any

from workload import Backend, Workload, main


class OursBackend(Backend):
    name = "yuebing"

    def __init__(self, model: str, w: Workload) -> None:
        from yuebing.engine.config import EngineConfig
        from yuebing.engine.engine import LLMEngine
        from yuebing.engine.sampling import SamplingParams

        self._params = SamplingParams
        self.config = EngineConfig(
            model=model, dtype=w.dtype, threads=int(w.extra.get("ours_threads", w.threads)),
            kv_cache_bytes=int(w.kv_gib * (1 << 30)),
            max_num_seqs=max(w.batches), max_batch_tokens=w.batch_tokens,
            max_model_len=max(w.max_len, 4096), prefix_caching=False,
            attention=w.extra.get("ours_attention", "auto"),
            batch_invariant=bool(w.extra.get("ours_batch_invariant", False)))
        self.engine = LLMEngine(self.config)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        sp = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.engine.generate(prompts, sp)
        return [len(o.output_token_ids) for o in outs]

    def describe(self) -> dict[str, Any]:
        import torch

        import yuebing

        e = self.engine
        return {"yuebing": yuebing.__version__, "torch": torch.__version__,
                "dtype": str(e.dtype), "threads": torch.get_num_threads(),
                "attention": e.attention, "prefill_attention": e.prefill_attention,
                "batch_invariant": self.config.batch_invariant,
                "attention_timings_ms": {k: round(v * 1e3, 3)
                                         for k, v in e.attention_timings.items()},
                "kv_blocks": e.pool.num_blocks,
                "block_size": e.block_size, "max_batch_tokens": self.config.max_batch_tokens}


if __name__ == "__main__":
    sys.exit(main(OursBackend))
