"""Fuzzing the Conductor's HTTP API (hypothesis): random JSON bodies, random field types and
raw bytes to ``/v1/completions`` and ``/v1/chat/completions`` of a Conductor serving fake
prefill + decode instances. Every answer is a 200 or a 4xx/503 with OpenAI's error body, never a
500, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from fake_instance import FakeLoop
from harness import MODEL, ConductorThread, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yuebing.protocol.instance import Role

ROUTES = ("/v1/completions", "/v1/chat/completions")
FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "stream", "stream_options", "n", "best_of", "logprobs",
          "echo", "min_tokens", "ignore_eos", "stop_token_ids", "tools", "user", "suffix",
          "response_format", "logit_bias")

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
token_ids = st.lists(st.integers(-5, 600) | st.integers(-(2**64), 2**64), min_size=0,
                     max_size=12)
message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", ""]) | values,
    "content": st.text(max_size=16) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]) | values,
         "text": st.text(max_size=8) | values}), max_size=2) | values})
plausible: dict[str, Any] = {
    "prompt": token_ids | st.lists(token_ids, max_size=2) | st.text(max_size=16),
    "messages": st.lists(message, max_size=3),
    "max_tokens": st.integers(-2, 20), "max_completion_tokens": st.integers(-2, 20),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 100), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20),
    "stop_token_ids": token_ids, "n": st.integers(0, 3), "seed": st.integers(-5, 2**65),
}
random_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL) | values},
    optional={f: (plausible[f] | values) if f in plausible else values for f in FIELDS})
valid_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.lists(st.integers(1, 500), min_size=1, max_size=40),
     "max_tokens": st.integers(1, 6)},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(
        -1, 50), "seed": st.integers(0, 2**31), "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
        "min_tokens": st.integers(0, 3), "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "user": st.text(max_size=8)})


@st.composite
def near_valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid completion request with one or two fields set to something random."""
    body = dict(draw(valid_bodies))
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(("model", *FIELDS)))
        body[key] = draw(values | plausible.get(key, values))
    return body


bodies = valid_bodies | near_valid_bodies() | random_bodies


@pytest.fixture(scope="module")
def conductor() -> Iterator[ConductorThread]:
    fl = FakeLoop()
    fakes = [fl.add(Role.PREFILL, "p0"), fl.add(Role.DECODE, "d0")]
    c = ConductorThread(instances=tuple(f.address for f in fakes), max_tokens_cap=16,
                        heartbeat_timeout_s=5.0)
    c.wait_ready(roles=("prefill", "decode"))
    yield c
    c.stop()
    fl.close()


def _dumps(body: object) -> bytes:
    """JSON as a careless client writes it (NaN and Infinity included, invalid in JSON)."""
    return json.dumps(body, allow_nan=True).encode()


def _check(status: int, body: Any) -> None:
    if status == 200 and isinstance(body, dict):
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0, body
    assert status != 500 and (status < 500 or status == 503), (status, body)
    if status == 200:
        return
    assert 400 <= status < 500 or status == 503, (status, body)
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and "param" in err and "code" in err


fuzz = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@fuzz
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_random_request_fields_get_a_precise_answer(conductor: ConductorThread, route: str,
                                                    body: dict[str, Any]) -> None:
    status, reply = request(conductor.url, "POST", route, _dumps(body), timeout_s=30)
    _check(status, reply)


@fuzz
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=64) | values.map(_dumps))
def test_garbage_bodies_are_400s(conductor: ConductorThread, route: str, raw: bytes) -> None:
    status, reply = request(conductor.url, "POST", route, raw, timeout_s=30)
    _check(status, reply)
    if not isinstance(reply, dict) or "choices" not in reply:
        assert status in (400, 413), (status, reply)


def test_still_serving_after_the_fuzz(conductor: ConductorThread) -> None:
    status, reply = request(conductor.url, "POST", "/v1/completions",
                            {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply
    status, health = request(conductor.url, "GET", "/health")
    assert status == 200 and health["inflight"] == 0 and not math.isnan(health["inflight"])
