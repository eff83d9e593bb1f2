"""Peer: Hugging Face ``transformers`` ``generate`` (greedy, KV cache, SDPA) on the exported model.

Runs in the peers venv as a subprocess of ``benchmarks/engine_peers.py``; see workload.py for the
method. Batches are equal-length prompts, so no padding is involved.
"""

from __future__ import annotations

import sys
from typing import Any

from workload import Backend, Workload, main


class TransformersBackend(Backend):
    name = "transformers"

    def __init__(self, model_dir: str, w: Workload) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(w.threads)
        self._torch = torch
        self._dtype = getattr(torch, w.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self._dtype).eval()
        self._pad = self.model.config.eos_token_id
        if isinstance(self._pad, list):
            self._pad = self._pad[0]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        torch = self._torch
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=self._pad)
        return [int(out.shape[1] - ids.shape[1])] * len(prompts)

    def describe(self) -> dict[str, Any]:
        import transformers

        return {"transformers": transformers.__version__, "torch": self._torch.__version__,
                "dtype": str(self._dtype), "threads": self._torch.get_num_threads(),
                "attn": self.model.config._attn_implementation}


if __name__ == "__main__":
    sys.exit(main(TransformersBackend))
