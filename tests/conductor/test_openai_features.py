"""The ``openai`` client against the Conductor (fake prefill + decode instances, the real
SmolLM2 tokenizer and chat template): logprobs (chat ``logprobs``/``top_logprobs``, completions
``logprobs``), ``n > 1`` and prompt lists, streamed and not, parse into the client's types with
OpenAI's shapes; usage counts every choice's tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_instance import FakeLoop
from harness import ConductorThread, request

from yuebing.protocol.instance import Role

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def conductor() -> Iterator[ConductorThread]:
    fl = FakeLoop()
    fakes = [fl.add(Role.PREFILL, "p0"), fl.add(Role.DECODE, "d0")]
    c = ConductorThread(model="smollm2", instances=tuple(f.address for f in fakes),
                        max_tokens_cap=16, heartbeat_timeout_s=5.0)
    c.wait_ready(roles=("prefill", "decode"))
    yield c
    c.stop()
    fl.close()


@pytest.fixture(scope="module")
def client(conductor: ConductorThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=conductor.url + "/v1", api_key="unused", max_retries=0)


def _token(tok_id: int) -> str:
    from yuebing.conductor.model import load_model_info
    t = load_model_info("smollm2").tokenizer
    assert t is not None
    return t.token_bytes(tok_id).decode("utf-8", errors="replace")


def test_chat_logprobs_and_n_not_streamed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=3,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 9
    firsts = set()
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 3 and c.finish_reason == "length"
        first = content[0]
        firsts.add(first.token)
        assert first.logprob == -0.5 and first.bytes == list(first.token.encode())
        assert [t.logprob for t in first.top_logprobs] == [-0.5, -1.5]
        assert first.top_logprobs[0].token == first.token
    assert len(firsts) == 3  # each choice its own tokens (the fakes: first + 10 j)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None and len(plain.choices) == 1


def test_chat_logprobs_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, n=2, logprobs=True, top_logprobs=1,
        stream=True, stream_options={"include_usage": True}))
    by_index: dict[int, list[float]] = {0: [], 1: []}
    roles = 0
    for ch in chunks[:-1]:
        (c,) = ch.choices
        roles += c.delta.role == "assistant"
        if c.logprobs is not None:
            for t in c.logprobs.content:
                by_index[c.index].append(t.logprob)
                assert len(t.top_logprobs) == 1
    assert roles == 2 and by_index == {0: [-0.5] * 3, 1: [-0.5] * 3}
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    finishes = [c.finish_reason for ch in chunks[:-1] for c in ch.choices if c.finish_reason]
    assert finishes == ["length", "length"]


def test_completions_logprobs_stream_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.token_logprobs == [-0.5] * 3
    assert lp.tokens[0] == _token(1000 + 1)  # the fakes' first token: 1000 + prompt length
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    assert all(len(top) == 2 and top[t] == -0.5 for top, t in zip(lp.top_logprobs, lp.tokens,
                                                                   strict=True))
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                            logprobs=0, stream=True))
    streamed = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for ch in chunks for c in ch.choices if c.logprobs
               for o in c.logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_prompt_lists_answer_in_order(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=[[1, 2], [3, 4, 5], "Hi there"],
                                  max_tokens=2, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    # choice i * n + j is prompt i's: the fakes' first token is 1000 + prompt length (+ 10 j)
    hi = len(_ids("Hi there"))
    firsts = [int(c.text.split()[0][1:]) for c in r.choices]
    assert firsts == [1002, 1012, 1003, 1013, 1000 + hi, 1010 + hi]
    assert r.usage.prompt_tokens == 5 + hi and r.usage.completion_tokens == 12
    ext = r.usage.model_extra["yuebing"]
    assert len(ext["prompts"]) == 3
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2,
                                            stream=True, n=3))
    indices = {c.index for ch in chunks for c in ch.choices}
    assert indices == set(range(6))
    ends = sorted(c.index for ch in chunks for c in ch.choices if c.finish_reason)
    assert ends == list(range(6))


def _ids(text: str) -> list[int]:
    from yuebing.conductor.model import load_model_info
    t = load_model_info("smollm2").tokenizer
    assert t is not None
    return t.encode(text)


def test_refused_fields_are_named(conductor: ConductorThread) -> None:
    for field, value in (("echo", True), ("suffix", "x"), ("logit_bias", {"1": 2}),
                         ("presence_penalty", 1.0), ("best_of", 3)):
        status, body = request(conductor.url, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "a", field: value})
        assert status == 400 and body["error"]["param"] == field, body
        assert field in body["error"]["message"]
    status, body = request(conductor.url, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": MESSAGES, "tools": []})
    assert status == 400 and body["error"]["param"] == "tools"
