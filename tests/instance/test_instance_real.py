"""The real SmolLM2-135M-Instruct through a prefill instance and a decode instance (separate
processes, KV streamed layer by layer) gives exactly the tokens of `LLMEngine.generate` in one
process: 5 prompts, one of 3,000 tokens, 64 new tokens each."""

from __future__ import annotations

import asyncio

import pytest
from instance_procs import InstanceProc, run_disagg

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.instance.client import InstanceClient
from yuebing.protocol.instance import Sampling

TEXTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 5, 8, 13,",
         "Explain what a KV cache is in one paragraph."]
SAMPLING = Sampling(max_tokens=64, temperature=0, ignore_eos=True)


def _case(dtype: str) -> tuple[list[list[int]], list[list[int]]]:
    e = LLMEngine(EngineConfig(model="smollm2", dtype=dtype, threads=1, batch_invariant=True))
    prompts = [e.encode_prompt(t) for t in TEXTS]
    long_text = "Summarize the following notes. " + " ".join(
        f"Note {i}: the transfer engine moved block {i * 7 % 97} to node {i % 5}."
        for i in range(400))
    prompts.append(e.encode_prompt(long_text)[:3000])
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    refs = [e.generate([p], params)[0].output_token_ids for p in prompts]
    return prompts, refs


def _serve(dtype: str, concurrent: bool) -> None:
    prompts, refs = _case(dtype)
    assert len(prompts[-1]) == 3000
    # equal to one engine's tokens, whatever the batching: the batch-invariant mode's promise
    flags = ("--dtype", dtype, "--kv-cache-bytes", "256MiB", "--no-warmup", "--batch-invariant")
    p_proc = InstanceProc("prefill", "smollm2", *flags, timeout_s=300)
    try:
        d_proc = InstanceProc("decode", "smollm2", *flags, timeout_s=300)
    except BaseException:
        p_proc.stop()
        raise

    async def go():
        p, d = InstanceClient(p_proc.address), InstanceClient(d_proc.address)
        runs = [run_disagg(p, d, f"r{i}", ids, SAMPLING) for i, ids in enumerate(prompts)]
        if concurrent:
            outs = await asyncio.gather(*runs)
        else:
            outs = [await r for r in runs]
        await p.close()
        await d.close()
        return outs
    try:
        outs = asyncio.run(go())
    finally:
        p_proc.stop()
        d_proc.stop()
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.error == "" and out.tokens == ref, (i, out.error)
    assert outs[-1].cached_tokens == 0


@pytest.mark.slow  # 140 s on 2 cores; test_instance_serving keeps a fast parity check
@pytest.mark.timeout(1200)
def test_disaggregated_greedy_equals_one_engine_fp32_all_at_once():
    _serve("float32", concurrent=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_disaggregated_greedy_equals_one_engine_bf16_one_at_a_time():
    _serve("bfloat16", concurrent=False)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_disaggregated_greedy_equals_one_engine_bf16_all_at_once():
    """Holds with the engine's batch-invariant kernels (EngineConfig.batch_invariant)."""
    _serve("bfloat16", concurrent=True)
