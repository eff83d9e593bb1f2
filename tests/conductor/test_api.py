"""HTTP boundary of the Conductor: every malformed request gets the right status and OpenAI's
error body, nothing is routed, and the server keeps serving. No instances are needed: requests
are refused before dispatch (a valid one gets 503 no_instances)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from harness import MODEL, ConductorThread, request, response

from yuebing.conductor.api import ApiError, Limits, parse_request
from yuebing.engine.tokenizer import Tokenizer

LIMITS = Limits(model_name=MODEL, max_model_len=1024, max_prompt_tokens=1024, max_tokens_cap=64)


@pytest.fixture(scope="module")
def server() -> Iterator[ConductorThread]:
    s = ConductorThread(max_body_bytes=4096, max_tokens_cap=64)
    yield s
    s.stop()


def _error(status: int, body: Any, param: str | None, code: str | None = None) -> None:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["param"] == param and err["code"] == code, err
    assert err["type"] == ("invalid_request_error" if status < 500 and status != 429
                           else err["type"])


CASES = [
    ("invalid json", "/v1/completions", b'{"model": ', 400, None, "invalid_json"),
    ("not an object", "/v1/completions", [1, 2], 400, None, None),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": [1]}, 400, "model",
     "model_not_found"),
    ("no model", "/v1/completions", {"prompt": [1]}, 400, "model", None),
    ("no messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400,
     "messages", None),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x",
                                                                         "content": "a"}]},
     400, "messages[0].role", None),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 0}, 400,
     "max_tokens", None),
    ("max_tokens negative", "/v1/completions", {"model": MODEL, "prompt": [1],
                                                "max_tokens": -3}, 400, "max_tokens", None),
    ("max_tokens over cap", "/v1/completions", {"model": MODEL, "prompt": [1],
                                                "max_tokens": 65}, 400, "max_tokens", None),
    ("prompt over context", "/v1/completions", {"model": MODEL, "prompt": [1] * 1024}, 400,
     "prompt", "context_length_exceeded"),
    ("prompt plus max_tokens over context", "/v1/completions",
     {"model": MODEL, "prompt": [1] * 1000, "max_tokens": 30}, 400, "max_tokens",
     "context_length_exceeded"),
    ("temperature wrong type", "/v1/completions", {"model": MODEL, "prompt": [1],
                                                   "temperature": "hot"}, 400, "temperature",
     None),
    ("max_tokens wrong type", "/v1/completions", {"model": MODEL, "prompt": [1],
                                                  "max_tokens": "5"}, 400, "max_tokens", None),
    ("stream wrong type", "/v1/completions", {"model": MODEL, "prompt": [1], "stream": 1}, 400,
     "stream", None),
    ("top_p out of range", "/v1/completions", {"model": MODEL, "prompt": [1], "top_p": 0},
     400, "top_p", None),
    ("n over max_n", "/v1/completions", {"model": MODEL, "prompt": [1], "n": 9}, 400, "n",
     None),
    ("n=0", "/v1/completions", {"model": MODEL, "prompt": [1], "n": 0}, 400, "n", None),
    ("best_of other than n", "/v1/completions", {"model": MODEL, "prompt": [1], "n": 2,
                                                 "best_of": 3}, 400, "best_of", None),
    ("logprobs over max", "/v1/completions", {"model": MODEL, "prompt": [1], "logprobs": 21},
     400, "logprobs", None),
    ("logprobs a bool on completions", "/v1/completions",
     {"model": MODEL, "prompt": [1], "logprobs": True}, 400, "logprobs", None),
    ("echo", "/v1/completions", {"model": MODEL, "prompt": [1], "echo": True}, 400, "echo",
     None),
    ("suffix", "/v1/completions", {"model": MODEL, "prompt": [1], "suffix": "x"}, 400,
     "suffix", None),
    ("presence_penalty", "/v1/completions", {"model": MODEL, "prompt": [1],
                                             "presence_penalty": 0.5}, 400,
     "presence_penalty", None),
    ("response_format", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
      "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
     400, "top_logprobs", None),
    ("top_logprobs over max", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "logprobs": True,
      "top_logprobs": 21}, 400, "top_logprobs", None),
    ("not utf-8", "/v1/completions", b'{"model": "\xff\xfe"}', 400, None, "invalid_json"),
    ("nested 4000 deep", "/v1/completions", b"[" * 4000, 400, None, "invalid_json"),
    ("nested in a field", "/v1/completions",
     b'{"model": "m", "user": ' + b"[" * 70 + b"]" * 70 + b"}", 400, None, "invalid_json"),
    ("NaN", "/v1/completions", b'{"model": "m", "temperature": NaN}', 400, None,
     "invalid_json"),
    ("number out of range", "/v1/completions", b'{"model": "m", "temperature": 1e400}', 400,
     None, "invalid_json"),
    ("huge token id", "/v1/completions", {"model": MODEL, "prompt": [1, 2**80]}, 400,
     "prompt", None),
    ("huge stop token id", "/v1/completions", {"model": MODEL, "prompt": [1],
                                               "stop_token_ids": [2**70]}, 400,
     "stop_token_ids", None),
    ("bad prompt in a list", "/v1/completions", {"model": MODEL, "prompt": [[1], []]}, 400,
     "prompt[1]", None),
    ("mixed prompt list", "/v1/completions", {"model": MODEL, "prompt": [[1], 2]}, 400,
     "prompt", None),
    ("stop wrong type", "/v1/completions", {"model": MODEL, "prompt": [1], "stop": 3}, 400,
     "stop", None),
    ("text prompt without tokenizer", "/v1/completions", {"model": MODEL, "prompt": "hi"}, 400,
     "prompt", None),
    ("chat without template", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400, "messages", None),
    ("negative token id", "/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "prompt",
     None),
    ("stream_options without stream", "/v1/completions",
     {"model": MODEL, "prompt": [1], "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("tools", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                     "content": "a"}],
                                       "tools": [{}]}, 400, "tools", None),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param", "code"), CASES,
                         ids=[c[0] for c in CASES])
def test_malformed_requests_get_openai_errors(server: ConductorThread, name: str, path: str,
                                             body: Any, status: int, param: str | None,
                                             code: str | None) -> None:
    got, payload = request(server.url, "POST", path, body)
    assert got == status, payload
    _error(status, payload, param, code)
    assert request(server.url, "GET", "/health")[0] == 200  # still serving


def test_body_over_the_limit_is_413(server: ConductorThread) -> None:
    status, body = request(server.url, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": [1] * 3000})
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_valid_request_without_instances_is_503_with_retry_after(server: ConductorThread
                                                                 ) -> None:
    conn, resp = response(server.url, "/v1/completions", {"model": MODEL, "prompt": [1, 2]})
    body = resp.read()
    conn.close()
    assert resp.status == 503 and resp.getheader("Retry-After") == "1", body
    assert b'"code":"no_instances"' in body and b'"type":"server_overloaded"' in body


def test_models_health_metrics_and_unknown_path(server: ConductorThread) -> None:
    status, models = request(server.url, "GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 1024  # the model's own before instances
    status, health = request(server.url, "GET", "/health")
    assert status == 200 and health["ready"] is False
    assert request(server.url, "GET", "/health?ready=1")[0] == 503
    status, text = request(server.url, "GET", "/metrics")
    assert status == 200 and "yuebing:rejected_requests_total" in text
    status, body = request(server.url, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"


def test_api_key_is_required_when_set() -> None:
    s = ConductorThread(api_key="sekrit")
    try:
        status, body = request(s.url, "GET", "/v1/models")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = request(s.url, "GET", "/v1/models", headers={"authorization": "Bearer no"})
        assert status == 401
        status, _ = request(s.url, "GET", "/v1/models",
                            headers={"authorization": "Bearer sekrit"})
        assert status == 200
        assert request(s.url, "GET", "/health")[0] == 200  # health stays open
    finally:
        s.stop()


class _Tok:
    """A stand-in tokenizer: one id per character, a trivial chat template."""

    vocab_size = 1000
    chat_template = "x"

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))


def test_parse_request_fields() -> None:
    tok: Tokenizer = _Tok()  # type: ignore[assignment]
    req = parse_request({"model": MODEL, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "hi"}], "max_completion_tokens": 7, "temperature": 0,
        "top_p": 0.5, "seed": 3, "stop": "x", "stream": True,
        "stream_options": {"include_usage": True}}, True, tok, LIMITS)
    assert req.prompt_ids == tok.encode("<system>be brief<user>hi")
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (7, 0.0, 0.5, 3, ["x"])
    assert req.stream and req.include_usage and req.chat
    # no max_tokens: the cap, or what is left of the context
    assert parse_request({"model": MODEL, "prompt": [1] * 1000}, False, None,
                         LIMITS).sampling.max_tokens == 24
    assert parse_request({"model": MODEL, "prompt": [[5, 6]]}, False, None,
                         LIMITS).prompt_ids == [5, 6]
    with pytest.raises(ApiError) as e:
        parse_request({"model": MODEL, "prompt": [1], "seed": True}, False, None, LIMITS)
    assert e.value.param == "seed"


def test_nesting_is_measured_outside_strings_and_fast() -> None:
    """Brackets inside string literals (escaped quotes too) are not nesting; a million ``[``
    is refused before it is decoded, in well under a second."""
    import json
    import time

    from yuebing.conductor.api import MAX_NESTING, decode_body

    text = 'say "[[[" \\" [' + "[" * 5000 + "{" * 100
    obj = decode_body(json.dumps({"model": MODEL, "prompt": text,
                                  "user": [[[[1]]]]}).encode())
    assert obj["prompt"] == text
    ok = b'{"a": ' + b"[" * (MAX_NESTING - 1) + b"]" * (MAX_NESTING - 1) + b"}"
    assert decode_body(ok)["a"]
    escaped = b"[" * (MAX_NESTING + 1) + b'"' + b'\\"' * 10**6  # unterminated, all escapes
    for deep in (b"[" * 10**6, b'{"a": ' + b"[" * (MAX_NESTING) + b"]" * MAX_NESTING + b"}",
                 escaped):
        start = time.process_time()
        with pytest.raises(ApiError) as e:
            decode_body(deep)
        assert e.value.status == 400 and e.value.code == "invalid_json"
        # linear scans take milliseconds; the quadratic regex this replaced took hours here
        assert time.process_time() - start < 5.0


def test_a_key_named_twice_in_one_object_is_refused() -> None:
    from yuebing.conductor.api import decode_body

    for body, key in ((b'{"model": "m", "prompt": "a", "model": "m"}', "model"),
                      (b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}',
                       "role")):
        with pytest.raises(ApiError) as e:
            decode_body(body)
        assert e.value.status == 400 and e.value.code == "invalid_json" and key in str(e.value)
    assert decode_body(b'{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}')["b"][1]["a"] == 3
