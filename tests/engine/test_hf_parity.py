"""Our model against transformers on the same weights: fp32 logits for a prompt and for each
decode step, and greedy continuations, for Llama (tied, GQA), Qwen2 (QKV bias, untied) and
llama3 RoPE scaling."""

from __future__ import annotations

import pytest
import torch
from engine_factories import build_hf_model

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {"tie_word_embeddings": False}),
    "llama3-rope": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
}
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 8, 130, 64, 1, 300, 12, 9, 88, 23]
STEPS = 6


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    path = build_hf_model(tmp_path_factory.mktemp(request.param), kind, **overrides)
    model = getattr(transformers, "Qwen2ForCausalLM" if kind == "qwen2" else
                    "LlamaForCausalLM").from_pretrained(path, dtype=torch.float32).eval()
    return path, model


def _hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = list(ids)
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(steps):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[-steps:], logits


@pytest.mark.parametrize("block_size,chunk,attention", [(4, 64, "grouped"), (16, 5, "grouped"),
                                                        (4, 7, "sdpa"), (4, 7, "paged")])
def test_logits_match_transformers(hf_case, block_size, chunk, attention):
    path, hf = hf_case
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", threads=1,
                                    block_size=block_size, num_blocks=32, max_num_seqs=4,
                                    max_batch_tokens=max(chunk, 4), attention=attention,
                                    batch_invariant=False))
    captured: list[torch.Tensor] = []
    engine.logits_hook = lambda rids, logits: captured.append(logits[0].clone())
    out = engine.generate([PROMPT], SamplingParams(max_tokens=STEPS, temperature=0))[0]
    ref_tokens, ref_logits = _hf_greedy(hf, PROMPT, STEPS)
    assert out.output_token_ids == ref_tokens
    assert len(captured) == STEPS
    for ours, ref in zip(captured, ref_logits, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_hf_config_is_read(hf_case):
    path, hf = hf_case
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", threads=1,
                                    num_blocks=8, attention="grouped",
                                    batch_invariant=False))
    mc = engine.model_config
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (3, 8, 2, 8)
    assert mc.tie_embeddings == hf.config.tie_word_embeddings
    assert mc.qkv_bias == (hf.config.model_type == "qwen2")


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_logprobs_match_transformers(hf_case, batch_invariant):
    """The logprobs a request gets (raw float32 log-softmax, chosen token and top 5) equal
    transformers' on the same weights in float32 within 1e-3, on the first token (from the
    prefill, of each of n=2 choices) and on the decode steps after it."""
    path, hf = hf_case
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", threads=1,
                                    block_size=4, num_blocks=32, max_num_seqs=4,
                                    batch_invariant=batch_invariant))
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=2,
                                                    logprobs=5, ignore_eos=True))
    outs = [o for _ in range(20) for o in engine.step() if o.request_id == rid]
    with torch.no_grad():
        for j in (0, 1):
            mine = [o for o in outs if o.index == j]
            ids = list(PROMPT) + mine[-1].output_token_ids
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
            for step, o in enumerate(mine):
                (lp,) = o.logprobs
                row = ref[len(PROMPT) - 1 + step]
                tok = o.new_token_ids[0]
                assert abs(lp.logprob - float(row[tok])) < 1e-3, (j, step)
                top = torch.topk(row, 5)
                assert lp.top_ids == top.indices.tolist()
                assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist(),
                                                      strict=True)) < 1e-3
