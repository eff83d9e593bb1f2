"""The bundled SmolLM2-135M-Instruct GGUF: chat answer, tokenizer, stop strings, streaming.
Parity with transformers' own GGUF loader is a slow test."""

from __future__ import annotations

import pytest
import torch

from yuebing.engine import native
from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.kernels import amx_available
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.weights import bundled_model_path, load_weights

GREEDY = SamplingParams(max_tokens=16, temperature=0)
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smol_weights():
    try:
        bundled_model_path()
    except Exception as e:  # noqa: BLE001 - the package is installed by `make install`
        pytest.skip(str(e))
    return load_weights("smollm2")


@pytest.fixture(scope="module")
def smol(smol_weights) -> LLMEngine:
    return LLMEngine(EngineConfig(num_blocks=128, threads=1), weights=smol_weights)


def test_config_from_gguf(smol):
    mc = smol.model_config
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim) == \
        (30, 576, 9, 3, 64)
    assert (mc.vocab_size, mc.intermediate_size, mc.rope_theta, mc.tie_embeddings) == \
        (49152, 1536, 100000.0, True)
    assert smol.eos_token_ids == frozenset({2})


def test_chat_answer_is_paris(smol):
    out = smol.generate([QUESTION], GREEDY, chat=True)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.output_token_ids[-1] == 2


def test_tokenizer_and_chat_template(smol):
    tok = smol.tokenizer
    ids = tok.encode("What is the capital of France? 12345 hello  world")
    # reference ids from transformers' GGUF tokenizer for the same file
    assert ids == [1780, 314, 260, 3575, 282, 4649, 47, 216, 33, 34, 35, 36, 37, 33662, 216, 905]
    assert tok.decode(ids) == "What is the capital of France? 12345 hello  world"
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[:1] == [1]


def test_stop_string_and_streaming_deltas(smol):
    deltas = []
    for out in smol.stream(QUESTION, SamplingParams(max_tokens=16, temperature=0,
                                                    stop=(" Paris",)), chat=True):
        deltas.append(out.text_delta)
    assert out.finished and out.finish_reason == "stop"
    assert "".join(deltas) == out.text == "The capital of France is"


def _chat_logits(engine: LLMEngine, steps: int = 6) -> tuple[list[int], list[torch.Tensor]]:
    captured: list[torch.Tensor] = []
    engine.logits_hook = lambda rids, logits: captured.append(logits[0].clone())
    prompt = [{"role": "user", "content": QUESTION + " Then tell me about its history."}]
    out = engine.generate([engine.tokenizer.encode_chat(prompt)],
                          SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))[0]
    engine.logits_hook = None
    return out.output_token_ids, captured


@pytest.fixture(scope="module")
def fp32_reference(smol_weights) -> tuple[list[int], list[torch.Tensor]]:
    return _chat_logits(LLMEngine(EngineConfig(dtype="float32", attention="grouped", batch_invariant=False,
                                               kernels="torch", num_blocks=64, threads=1),
                                  weights=smol_weights))


@pytest.mark.parametrize(("attention", "prefill"), [("grouped", "same"), ("sdpa", "same"),
                                                    ("grouped", "blas"), ("grouped", "flash"),
                                                    ("grouped", "flash_amx"),
                                                    ("paged", "grouped")])
def test_bf16_paths_track_float32(smol_weights, fp32_reference, attention, prefill):
    """bf16 weights + each attention path stay close to the float32 model (a regression
    test: bf16-rounded attention scores once turned the answer into nonsense)."""
    if prefill == "flash_amx" and not (native.load().ok and amx_available()):
        pytest.skip("no AMX-BF16 tiles on this CPU / build")
    ref_tokens, ref_logits = fp32_reference
    bf = LLMEngine(EngineConfig(dtype="bfloat16", attention=attention, num_blocks=64,
                                threads=1, prefill_attention=prefill, batch_invariant=False),
                     weights=smol_weights)
    tokens, logits = _chat_logits(bf)
    assert tokens == ref_tokens
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True))
    assert worst < 1.0, worst


def test_amx_projections_track_float32(smol_weights, fp32_reference, monkeypatch, tmp_path):
    """Every row count of every projection on the native AMX linear (gate/up with SiLU·mul
    fused; decode steps too, fused decode off) gives the float32 model's greedy tokens."""
    from yuebing.core import choices as core_choices
    from yuebing.engine import amx_linear
    from yuebing.engine import engine as engine_module
    from yuebing.engine import model as model_module
    from yuebing.engine.linear import amx_key
    if not (native.load().ok and amx_linear.available()):
        pytest.skip("no AMX-BF16 tiles on this CPU / build")
    monkeypatch.setattr(core_choices, "choice_dir", lambda: tmp_path)
    monkeypatch.setattr(engine_module, "choose_amx", lambda triples, ops, points: (
        {amx_key(lin, silu): list(points) for lin, _, silu in triples}, {}))
    monkeypatch.setattr(model_module, "plain_ranges", lambda points, chosen: ((1, 1 << 30),)
                        if chosen else ())
    bf = LLMEngine(EngineConfig(dtype="bfloat16", num_blocks=64, threads=1, fused_decode=0,
                                batch_invariant=False), weights=smol_weights)
    assert all(lay.gate_up.amx_silu and lay.down.amx is not None for lay in bf.model.layers)
    tokens, logits = _chat_logits(bf)
    assert tokens == fp32_reference[0]
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, fp32_reference[1],
                                                           strict=True))
    assert worst < 1.0, worst


def test_fused_decode_answers_like_op_by_op(smol_weights, fp32_reference):
    """The fused small-batch decode (bf16 GEMVs on AVX512-BF16) tracks the float32 model and
    gives the op-by-op path's greedy answer, alone and batched. (bf16 runs of this model part
    from each other on open-ended prompts after ~10 tokens whatever the path: oneDNN's own
    kernels for 1 and 3 rows do too.)"""
    from yuebing.engine import fused_decode
    if not (native.load().ok and fused_decode.available()):
        pytest.skip("no AVX512-BF16 build of the native kernels")
    bf = LLMEngine(EngineConfig(dtype="bfloat16", num_blocks=128, threads=1, fused_decode=8,
                                batch_invariant=False), weights=smol_weights)
    tokens, logits = _chat_logits(bf)
    assert tokens == fp32_reference[0]
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, fp32_reference[1],
                                                           strict=True))
    assert worst < 1.0, worst
    # batched with other chats, the France answer stays the op-by-op path's, alone or not
    chats = [[{"role": "user", "content": q}] for q in
             (QUESTION, "Write a haiku about the sea.", "List three prime numbers.")]
    ids = [bf.tokenizer.encode_chat(c) for c in chats]
    fused = bf.generate(ids, GREEDY)[0].output_token_ids
    alone = bf.generate(ids[:1], GREEDY)[0].output_token_ids
    fused_model = bf.model.fused
    bf.model.fused = None
    try:
        ops = bf.generate(ids, GREEDY)[0].output_token_ids
    finally:
        bf.model.fused = fused_model
    assert fused == ops == alone
    assert "Paris" in bf.tokenizer.decode(fused)


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(smol_weights):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = bundled_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=64, threads=1,
                                    block_size=16), weights=smol_weights)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    captured: list[torch.Tensor] = []
    engine.logits_hook = lambda rids, logits: captured.append(logits[0].clone())
    out = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0))[0]
    seq = list(ids)
    with torch.no_grad():
        for step, tok in enumerate(out.output_token_ids):
            ref = hf(torch.tensor([seq])).logits[0, -1].float()
            torch.testing.assert_close(captured[step], ref, rtol=1e-3, atol=1e-3)
            assert int(ref.argmax()) == tok
            seq.append(tok)


@pytest.mark.slow
def test_cli_generate_chat_answers_paris(capsys):
    from yuebing.cli.main import main

    rc = main(["generate", "--chat", QUESTION, "--max-tokens", "16", "--temperature", "0",
               "--threads", "1"])
    assert rc == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def _step_logits(engine: LLMEngine, runs: list[list[list[int]]]) -> dict[str, list[torch.Tensor]]:
    """Every step's float32 logits per request, the requests added run after run."""
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(ids: list[str], rows: torch.Tensor) -> None:
        for rid, row in zip(ids, rows, strict=True):
            seen.setdefault(rid, []).append(row.clone())
    engine.logits_hook = hook
    params, n = SamplingParams(max_tokens=6, temperature=0), 0
    for run in runs:
        for ids in run:
            engine.add_request(ids, params, request_id=str(n))
            n += 1
        while engine.has_unfinished():
            engine.step()
    return seen


def test_bf16_logits_alone_equal_batched(smol_weights):
    """Batch invariance at SmolLM2's real widths, every logit bit for bit: oneDNN's bf16 matmul
    for fewer than 8 rows sums in another order on AVX-512 BF16 CPUs (41 of 57 logit rows
    differed before the engine padded short matmul inputs, `Linear.min_rows`)."""
    texts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 5, 8, 13,",
             "Explain what a KV cache is.", "List three colours:", "def fib(n):",
             "Once upon a time", "The KV cache"]

    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(dtype="bfloat16", threads=1, num_blocks=64,
                                      prefix_caching=False, batch_invariant=True),
                         weights=smol_weights)
    alone_engine = engine()
    prompts = [alone_engine.encode_prompt(t) for t in texts]
    alone = _step_logits(alone_engine, [[p] for p in prompts])
    together = _step_logits(engine(), [prompts])
    assert alone.keys() == together.keys()
    for rid in alone:
        assert all(torch.equal(a, b) for a, b in zip(alone[rid], together[rid], strict=True)), rid
