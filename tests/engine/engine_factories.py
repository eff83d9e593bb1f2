"""Factories for engine tests: tiny models (dummy and transformers-built) and engines over them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.weights import LoadedWeights, dummy_weights, parse_dummy_spec

TINY = "dummy:preset=tiny,vocab=256,layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,ctx=512,tie=0"


def tiny() -> LoadedWeights:
    return dummy_weights(parse_dummy_spec(TINY), seed=3)


def make_engine(weights: LoadedWeights, **kw: object) -> LLMEngine:
    """A float32 CPU engine over ``weights`` (small pool unless told otherwise), on the
    measured attention paths (``grouped``; batch-invariant mode off unless told otherwise);
    chunks never cut by the clock (``mixed_step_s`` 0) unless told otherwise, so two runs
    step alike."""
    opts: dict[str, object] = dict(model=TINY, dtype="float32", device="cpu", threads=1,
                                   num_blocks=64, block_size=4, max_batch_tokens=64,
                                   max_num_seqs=16, attention="grouped", batch_invariant=False,
                                   mixed_step_s=0.0)
    opts.update(kw)
    return LLMEngine(EngineConfig(**opts), weights=weights)  # type: ignore[arg-type]


def prompts(n: int, vocab: int = 256, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def build_hf_model(path: Path, kind: str = "llama", **overrides: object) -> Path:
    """Save a tiny random transformers model (fp32 safetensors) to ``path``; return it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common: dict[str, object] = dict(
        vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
    common.update(overrides)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF init is tiny (std 0.02): spread the logits so argmax is stable
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path
