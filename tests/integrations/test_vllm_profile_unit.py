"""A vLLM instance's start-up profile without vLLM: the grid `profile.measure` times on a probe
that answers like a server with a prefix cache, the Conductor's fit of it, the cache per
signature and role, the decode prompts, and vLLM's per-request queue time from a stream's usage
chunk."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from yuebing.conductor.calibration import fit_profile
from yuebing.instance import profile_cache
from yuebing.integrations.vllm import profile as vp
from yuebing.integrations.vllm.instance import (
    VllmInstance,
    VllmInstanceConfig,
    completion_body,
    vllm_queue_s,
)
from yuebing.protocol.instance import EventKind, Role, Sampling


def truth_prefill(new: int, cached: int) -> float:
    return 0.02 + 4e-4 * new + 1e-5 * cached + 1e-7 * new * new + 2e-8 * new * cached


def truth_step(batch: int, context: int) -> float:
    return 0.015 + 2e-3 * batch + 3e-6 * context


class FakeProbe(vp.VllmProbe):
    """Times from `truth_prefill` / `truth_step`; prompts it saw are its prefix cache."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9", "m", 1000, seed=1)
        self.seen: list[list[int]] = []
        self.asked: list[tuple[int, int]] = []

    def prefill(self, prompt: list[int]) -> float:
        cached = max((len(p) for p in self.seen if prompt[:len(p)] == p and len(p) < len(prompt)),
                     default=0)
        self.seen.append(prompt)
        self.asked.append((len(prompt) - cached, cached))
        return truth_prefill(len(prompt) - cached, cached)

    def decode_step(self, batch: int, context: int) -> float:
        return truth_step(batch, context)


SIG = vp.signature("0.32.0", "m", "float32", 128, "fp", vp.started_hardware(2))


def test_grid_per_role_and_the_conductor_fits_it() -> None:
    probe = FakeProbe()
    p = vp.measure(probe, Role.PREFILL, SIG, 4352)
    assert [(n, c) for n, c, _ in p.prefill] == [(n, c) for c in vp.PREFILL_CACHED
                                                   for n in vp.PREFILL_NEW]
    assert p.decode == [] and p.configuration == SIG
    # the cached prefix was computed once, then hit by each prompt after it
    assert probe.asked[1:] == [(n, 0) for n in vp.PREFILL_NEW] + [(1024, 0)] + \
        [(n, 1024) for n in vp.PREFILL_NEW]
    fit = fit_profile(p, "prefill")
    assert fit.predict(700, 1024) == pytest.approx(truth_prefill(700, 1024), rel=1e-6)
    d = vp.measure(FakeProbe(), Role.DECODE, SIG, 4352)
    assert d.prefill == [] and len(d.decode) == len(vp.DECODE_BATCHES) * len(vp.DECODE_CONTEXTS)
    assert fit_profile(d, "decode").predict(8, 1000) == pytest.approx(truth_step(8, 1000))
    short = vp.measure(FakeProbe(), Role.COUPLED, SIG, 2000)  # points past the context cut
    assert max(n + c for n, c, _ in short.prefill) < 2000
    assert all(c // b + vp.DECODE_STEPS < 2000 for b, c, _ in short.decode)


def test_cached_per_signature_and_role(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[Role] = []
    real = vp.measure

    def counting(probe, role, sig, limit):  # type: ignore[no-untyped-def]
        calls.append(role)
        return real(probe, role, sig, limit)

    monkeypatch.setattr(vp, "measure", counting)
    first = vp.vllm_profile(FakeProbe(), Role.PREFILL, SIG, 4352)
    assert vp.vllm_profile(FakeProbe(), Role.PREFILL, SIG, 4352) == first
    assert calls == [Role.PREFILL]
    vp.vllm_profile(FakeProbe(), Role.DECODE, SIG, 4352)  # another role: its own grid
    other = {**SIG, "vllm": "0.33.0"}  # another configuration is measured again, never reused
    assert vp.vllm_profile(FakeProbe(), Role.PREFILL, other, 4352).configuration == other
    assert calls == [Role.PREFILL, Role.DECODE, Role.PREFILL]
    assert len(list((tmp_path / "yuebing" / "profiles").glob("*.json"))) == 3


def test_signature_names_the_vllm_configuration_and_the_machine() -> None:
    assert {k: SIG[k] for k in ("engine", "vllm", "model", "dtype", "block_size", "threads",
                                "kv")} == {"engine": "vllm", "vllm": "0.32.0", "model": "m",
                                           "dtype": "float32", "block_size": "128",
                                           "threads": "2", "kv": "fp"}
    assert SIG["machine"].endswith("| 2 cores") and SIG["accelerator"] == "cpu"
    # a vLLM at --vllm-url: keyed by the accelerator its operator names, not this host's CPU
    # or yuebing's --threads; two names, two cache files
    given = vp.signature("0.32.0", "m", "float32", 128, "fp", vp.given_hardware("8x H100 TP8"))
    assert given["accelerator"] == "8x H100 TP8" and "threads" not in given
    assert given["machine"] == "given"
    keys = {profile_cache.cache_key(s, Role.PREFILL, 1) for s in (
        SIG, given, {**given, "accelerator": "cpu"})}
    assert len(keys) == 3


def test_a_given_vllm_must_name_its_accelerator_to_be_profiled() -> None:
    with pytest.raises(ValueError, match="--vllm-url http://h:1: name what that vLLM runs on "
                                         "with --accelerator"):
        VllmInstanceConfig(vllm_url="http://h:1")
    assert VllmInstanceConfig(vllm_url="http://h:1", accelerator="8x H100").accelerator
    assert not VllmInstanceConfig(vllm_url="http://h:1", startup_profile=False).startup_profile
    with pytest.raises(ValueError, match="--accelerator 'gpu' names the hardware of a vLLM at "
                                         "--vllm-url"):
        VllmInstanceConfig(accelerator="gpu")


def test_hello_carries_the_signature_and_profile(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "hidden_size": 576, "head_dim": 64}))
    profile = vp.measure(FakeProbe(), Role.COUPLED, SIG, 4352)
    inst = VllmInstance(VllmInstanceConfig(startup_profile=False, vllm_url="http://127.0.0.1:9",
                                           model_dir=str(tmp_path)), SIG, profile)
    try:
        hello = inst.hello(0)
        assert hello.engine == SIG and hello.profile == profile
    finally:
        inst.sock.close()
        inst.ctx.term()


def test_queue_time_from_the_usage_chunk() -> None:
    assert vllm_queue_s({"choices": [], "metrics": {"queue_time_ms": 12.5}}) == 0.0125
    assert vllm_queue_s({"choices": [], "usage": {}}) is None
    assert vllm_queue_s({"metrics": {"queue_time_ms": None}}) is None
    assert vllm_queue_s({"metrics": "x"}) is None
    assert vllm_queue_s({"metrics": {"queue_time_ms": -1}}) == 0.0


def test_decode_prompts_share_a_base_per_slot_and_end_fresh() -> None:
    """The points share each slot's base (cached once); the sequences of one batch do not
    (a shared prefix's KV is read once for all, and the step would be measured too fast)."""
    probe = vp.VllmProbe("http://127.0.0.1:9", "m", 50000, seed=3)
    a, b, long = probe.decode_prompt(512), probe.decode_prompt(512), probe.decode_prompt(2048)
    assert len(a) == len(b) == 512 and len(long) == 2048
    tail = vp.DECODE_TAIL
    assert a[:-tail] == b[:-tail] == long[:512 - tail] and a[-tail:] != b[-tail:]
    other = probe.decode_prompt(512, slot=1)
    assert len(other) == 512 and other[:64] != a[:64]
    assert probe.decode_prompt(1024, slot=1)[:512 - tail] == other[:-tail]
    assert len(probe.decode_prompt(4)) == 4  # shorter than the tail: all fresh


def test_vllm_queue_time_is_split_out_of_prefill(tmp_path) -> None:
    """A fake vLLM answers after 0.2 s and says the request queued 150 ms of it: FINISH's
    breakdown has queue_s 0.15 and prefill_s the rest; a decode's continuation, decode_wait_s
    0.15."""
    async def completions(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse()
        await r.prepare(request)
        await asyncio.sleep(0.2)  # a fake's delay: the time to its first token
        for chunk in ({"choices": [{"token_ids": [5], "text": "a"}]},
                      {"choices": [{"token_ids": [6], "text": "b", "finish_reason": "length"}]},
                      {"choices": [], "usage": {}, "metrics": {"queue_time_ms": 150.0}}):
            await r.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await r.write(b"data: [DONE]\n\n")
        return r

    async def run() -> list:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        (tmp_path / "config.json").write_text(json.dumps(
            {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "hidden_size": 576, "head_dim": 64}))
        inst = VllmInstance(VllmInstanceConfig(startup_profile=False,
                                               vllm_url=f"http://127.0.0.1:{port}",
                                               model_dir=str(tmp_path)))
        events: list = []
        inst._event = lambda ident, ev: events.append(ev)  # type: ignore[method-assign]
        inst.http = aiohttp.ClientSession()
        try:
            body = completion_body(inst.cfg, [1, 2, 3], Sampling(max_tokens=2))
            await inst._relay(b"c", "r1", body, 3, 0, None)
            # a decode's continuation (one token came from the prefill): its vLLM's queue
            await inst._relay(b"c", "r2", body, 3, 1, None)
        finally:
            await inst.http.close()
            inst.sock.close()
            inst.ctx.term()
            await runner.cleanup()
        return events

    events = asyncio.run(run())
    assert [e.kind for e in events] == [EventKind.FIRST_TOKEN, EventKind.TOKENS,
                                        EventKind.FINISH] + [EventKind.TOKENS] * 2 + \
        [EventKind.FINISH]
    b = events[2].breakdown
    assert b.queue_s == pytest.approx(0.15)
    assert 0.05 <= b.prefill_s < 5.0 and b.decode_wait_s == 0
    d = events[-1].breakdown
    assert d.decode_wait_s == pytest.approx(0.15) and d.queue_s == d.prefill_s == 0
