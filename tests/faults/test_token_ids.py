"""vLLM's ``return_token_ids`` extension of the Conductor's API: each choice carries the
generated token ids, so the greedy outputs of a model without a tokenizer (``dummy``), as the
fault and soak tests use, can be compared (streamed and whole bodies)."""

from __future__ import annotations

import json

import pytest

from yuebing.conductor.api import ApiError, Limits, parse_request
from yuebing.conductor.delta import Delta
from yuebing.conductor.render import Choices, Renderer
from yuebing.conductor.stats import RequestStats

LIMITS = Limits(model_name="m", max_model_len=64, max_prompt_tokens=64, max_tokens_cap=8)


def test_parse_takes_return_token_ids_and_refuses_a_wrong_type() -> None:
    base = {"model": "m", "prompt": [1, 2]}
    assert not parse_request(base, False, None, LIMITS).return_token_ids
    assert parse_request({**base, "return_token_ids": True}, False, None,
                         LIMITS).return_token_ids
    with pytest.raises(ApiError) as e:
        parse_request({**base, "return_token_ids": 1}, False, None, LIMITS)
    assert e.value.param == "return_token_ids"


@pytest.mark.parametrize("chat", [False, True])
def test_renderer_adds_token_ids_only_when_asked(chat: bool) -> None:
    with_ids = Renderer(chat, "m", "r1", False, token_ids=True)
    plain = Renderer(chat, "m", "r1", False)
    chunk = json.loads(with_ids.chunk(Delta([5, 6], "", None, 0.0))[len(b"data: "):])
    assert chunk["choices"][0]["token_ids"] == [5, 6]
    assert "token_ids" not in json.loads(plain.chunk(Delta([5], "", None, 0.0))[
        len(b"data: "):])["choices"][0]
    stats = RequestStats(request_id="r1", arrival_s=0.0, prompt_tokens=2)
    three, one = Choices(), Choices()
    three.add(Delta([5, 6, 7], "", "stop", 0.0))
    one.add(Delta([5], "", "stop", 0.0))
    body = json.loads(with_ids.full(three, [stats]))
    assert body["choices"][0]["token_ids"] == [5, 6, 7]
    assert "token_ids" not in json.loads(plain.full(one, [stats]))["choices"][0]
