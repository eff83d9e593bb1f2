"""Fuzzing the Conductor's HTTP API (hypothesis): random JSON bodies, random field types and
raw bytes (not UTF-8, truncated, mutated, nested a million deep, NaN/Infinity, numbers out of
range, duplicate keys) to ``/v1/completions`` and ``/v1/chat/completions`` of a Conductor
serving fake prefill + decode instances. Every answer is a 200 or a 4xx with OpenAI's error
body, never a 5xx, and the server keeps serving afterwards. The ``slow`` target sends 10,000
bad bodies to a Conductor process and checks its RSS stays flat."""

from __future__ import annotations

import http.client
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_instance import FakeLoop
from harness import MODEL, ConductorThread, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procs import Proc

from yuebing.protocol.instance import Role

ROUTES = ("/v1/completions", "/v1/chat/completions")
FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "stream", "stream_options", "n", "best_of", "logprobs",
          "echo", "min_tokens", "ignore_eos", "stop_token_ids", "tools", "user", "suffix",
          "response_format", "logit_bias", "top_logprobs", "presence_penalty",
          "frequency_penalty")

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
    "stop_token_ids": token_ids, "n": st.integers(0, 10), "seed": st.integers(-5, 2**65),
    "logprobs": st.booleans() | st.integers(-1, 22), "top_logprobs": st.integers(-1, 22),
    "best_of": st.integers(0, 4), "echo": st.booleans(),
    "presence_penalty": st.floats(-1, 1) | st.just(0),
}
random_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL) | values},
    optional={f: (plausible[f] | values) if f in plausible else values for f in FIELDS})
one_prompt = st.lists(st.integers(1, 500), min_size=1, max_size=40)
valid_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": one_prompt | st.lists(one_prompt, min_size=1,
                                                              max_size=3),
     "max_tokens": st.integers(1, 6)},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(
        -1, 50), "seed": st.integers(0, 2**31), "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
        "min_tokens": st.integers(0, 3), "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "user": st.text(max_size=8),
        "n": st.integers(1, 3), "logprobs": st.integers(0, 5)})


@st.composite
def near_valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid completion request with one or two fields set to something random."""
    body = dict(draw(valid_bodies))
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(("model", *FIELDS)))
        body[key] = draw(values | plausible.get(key, values))
    return body


bodies = valid_bodies | near_valid_bodies() | random_bodies


def bad_body(rng: random.Random, valid: bytes, deepest: int = 10**6) -> bytes:
    """One malformed body made from the valid body ``valid``: truncated, bytes mutated, not
    UTF-8, nested deep, NaN/Infinity, a number out of range, a duplicate key, or random."""
    kind = rng.randrange(9)
    if kind == 0:
        return valid[:rng.randrange(len(valid))]
    if kind == 1:
        b = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 2:
        bad = rng.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80"])
        return valid.replace(b'"model": "', b'"model": "' + bad, 1)
    if kind == 3:
        depth = rng.choice([65, 100, 1000, 10**4, 10**5, deepest])
        close = rng.choice([b"]" * depth, b""])
        return b'{"model": "m", "prompt": ' + b"[" * depth + close + b"}"
    if kind == 4:
        depth = rng.choice([65, 1000, 10**5])
        return b'{"model": "m", "messages": ' + b'[{"content": ' * depth + b"1" + b"}]" * depth \
            + b"}"
    if kind == 5:
        num = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400",
                          b"9" * 400, b"-" + b"9" * 30, b"1e-999"])
        field = rng.choice([b"max_tokens", b"temperature", b"top_p", b"seed", b"n", b"logprobs"])
        return valid[:-1] + b', "' + field + b'": ' + num + b"}"
    if kind == 6:  # duplicate keys, the later one wrong
        return valid[:-1] + rng.choice([b', "model": 3', b', "prompt": {}', b', "n": "x"',
                                        b', "max_tokens": 1', b', "prompt": [[1], "a"]']) + b"}"
    if kind == 7:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 80)))
    return rng.choice([b"", b"null", b"[]", b'"x"', b"{", b"{}", b'{"model": null}',
                       b"\xef\xbb\xbf{}", b'{"a": "\\ud800"}', b'{"a": "\\u00"}'])


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
    assert status < 500, (status, body)  # no 5xx, whatever the body
    if status == 200 and isinstance(body, dict):
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0, body
        assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    if status == 200:
        return
    assert 400 <= status < 500, (status, body)
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


@fuzz
@given(route=st.sampled_from(ROUTES), body=valid_bodies, seed=st.integers(0, 2**32))
def test_malformed_bytes_are_400s(conductor: ConductorThread, route: str, body: dict[str, Any],
                                  seed: int) -> None:
    raw = bad_body(random.Random(seed), _dumps(body), deepest=10**5)
    status, reply = request(conductor.url, "POST", route, raw, timeout_s=30)
    _check(status, reply)


def test_still_serving_after_the_fuzz(conductor: ConductorThread) -> None:
    status, reply = request(conductor.url, "POST", "/v1/completions",
                            {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply
    status, health = request(conductor.url, "GET", "/health")
    assert status == 200 and health["inflight"] == 0 and not math.isnan(health["inflight"])


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_ten_thousand_bad_bodies_no_5xx_flat_rss(tmp_path: Path) -> None:
    """The issue's target: 10,000 bad bodies (random bytes, truncations, mutations, nesting to
    10^6, NaN, out-of-range numbers, duplicate keys) to a Conductor process: no 5xx, its RSS
    flat after warm-up, and it still answers a good request."""
    fl = FakeLoop()
    fakes = [fl.add(Role.PREFILL, "p0"), fl.add(Role.DECODE, "d0")]
    proc = Proc("conductor", ["conductor", "--model", MODEL, "--port", "0", "--instances",
                              ",".join(f.address for f in fakes), "--no-access-log",
                              "--max-tokens-cap", "16"], tmp_path, 120)
    try:
        url = str(proc.info["url"])
        deadline = time.monotonic() + 30
        while request(url, "GET", "/health?ready=1")[0] != 200:
            assert time.monotonic() < deadline, "the instances did not join"
            time.sleep(0.05)
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        rng = random.Random(30)
        valid = [_dumps({"model": MODEL, "prompt": [rng.randint(1, 500) for _ in range(20)],
                         "max_tokens": 2, "n": rng.randint(1, 2), "logprobs": 1})
                 for _ in range(50)]
        statuses: dict[int, int] = {}
        warm = 0
        start = time.monotonic()
        for i in range(10_000):
            if i == 1000:
                warm = _rss_kib(proc.proc.pid)
            route = ROUTES[i % 2]
            body = bad_body(rng, rng.choice(valid))
            try:
                conn.request("POST", route, body=body,
                             headers={"content-type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, OSError):
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                continue
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            assert resp.status < 500, (resp.status, raw[:300], body[:200])
            if resp.getheader("connection", "") == "close":
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
        end = _rss_kib(proc.proc.pid)
        took = time.monotonic() - start
        assert sum(statuses.values()) >= 9_900, statuses
        assert end - warm < 32 * 1024, f"RSS grew from {warm} to {end} KiB ({statuses})"
        status, reply = request(url, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "n": 2})
        assert status == 200 and reply["usage"]["completion_tokens"] == 6, reply
        print(f"10,000 bad bodies in {took:.1f} s: {statuses}; RSS {warm} -> {end} KiB")
    finally:
        proc.stop()
        fl.close()
