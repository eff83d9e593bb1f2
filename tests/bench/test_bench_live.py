"""The load generator against a real HTTP server (`openai_fake.FakeServer` on 127.0.0.1):
what it sends, what it measures, how it counts 429s and failures, closed-loop concurrency,
and the checks made before any load."""

from __future__ import annotations

import socket

import pytest
from openai_fake import FakeServer

from yuebing.bench.config import BenchConfig
from yuebing.bench.result import Status
from yuebing.bench.runner import run_bench
from yuebing.bench.workload import build_workload
from yuebing.core.errors import InputError
from yuebing.trace.model import Request, Trace
from yuebing.trace.synth import synthesize


def _docqa(questions: int = 3, output: int = 4) -> Trace:
    return synthesize("docqa", documents=2, questions_per_document=questions,
                      min_document_tokens=1024, max_document_tokens=2048, question_tokens=64,
                      output_tokens=output, rate_per_s=50.0, seed=1)


def _trace(n: int, output: int = 3) -> Trace:
    return Trace(tuple(Request(10 * i, 512, output, (i,)) for i in range(n)))


def _run(fake: FakeServer, trace: Trace, **kw: object):  # type: ignore[no-untyped-def]
    cfg = BenchConfig(endpoint=fake.url, block_tokens=32, **kw)  # type: ignore[arg-type]
    model, runs = run_bench(cfg, [(None, build_workload(trace, cfg))])
    return model, runs[0]


def test_streams_token_id_prompts_and_measures_each_request(fake: FakeServer) -> None:
    fake.behaviour.first_token_delay_s = 0.05
    trace = _docqa()
    cfg = BenchConfig(endpoint=fake.url, block_tokens=32)
    sent = build_workload(trace, cfg)
    model, runs = run_bench(cfg, [(None, sent)])
    run = runs[0]
    assert model == "fake-model"
    assert [r.status for r in run.results] == [Status.OK] * 6
    assert sorted(tuple(b["prompt"]) for b in fake.bodies) == sorted(r.prompt for r in sent)
    body = fake.bodies[0]
    assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"]
    for r in run.results:
        assert r.output_tokens == 4 and len(r.token_times_s) == 4
        assert r.ttft_s >= 0.05  # the server waits that long before the first token
        assert r.prompt_tokens == r.input_tokens
    # every document's first question misses the cache; the other four reuse its full blocks
    cached = sorted(r.cached_tokens or 0 for r in run.results)
    assert cached[:2] == [0, 0] and all(c >= 16 * (1024 * 32 // 512 // 16) for c in cached[2:])
    s = run.summary
    assert (s["completed"], s["errors"], s["rejected"]) == (6, 0, 0)
    assert s["tokens"]["cached_reported_by"] == 6 and s["tokens"]["cached"] == sum(cached)


def test_failures_are_counted_by_kind(fake: FakeServer) -> None:
    fake.behaviour.actions = {0: "429", 1: "500", 2: "break", 3: "stream_error", 4: "no_tokens",
                              5: "not_sse", 6: "bad_utf8"}
    _, run = _run(fake, _trace(9), slo_ttft=(300.0,), slo_tbt=(300.0,))
    s = run.summary
    assert (s["requests"], s["completed"], s["rejected"], s["errors"]) == (9, 2, 1, 6)
    assert s["errors_by_kind"] == {"bad_response": 2, "http_500": 1, "incomplete": 1,
                                   "no_tokens": 1, "stream_error": 1}
    assert s["attainment"] == 2 / 9


@pytest.mark.parametrize("token_ids", [False, True])
def test_a_model_without_tokenizer_streams_empty_text_and_succeeds(fake: FakeServer,
                                                                   token_ids: bool) -> None:
    # a tokenizer-less model (``dummy:``) streams one empty-text chunk per token: success is
    # judged from the completed stream and the usage (or token ids), not from text
    fake.behaviour.tokenizer_less = True
    fake.behaviour.token_delay_s = 0.01
    _, run = _run(fake, _trace(3, output=5), return_token_ids=token_ids)
    assert [(r.status, r.error) for r in run.results] == [(Status.OK, "")] * 3
    assert all(b.get("return_token_ids", False) is token_ids for b in fake.bodies)
    for r in run.results:
        assert r.output_tokens == 5 and len(r.token_times_s) == 5
        assert r.tbt_s >= 0.01  # the chunks' times, not one timestamp
    assert run.summary["completed"] == 3 and run.summary["errors"] == 0


def test_empty_text_without_a_token_count_is_no_tokens(fake: FakeServer) -> None:
    fake.behaviour.tokenizer_less = True
    fake.behaviour.report_usage = False
    _, run = _run(fake, _trace(1))
    assert (run.results[0].status, run.results[0].error) == (Status.ERROR, "no_tokens")


def test_a_request_without_answer_times_out(fake: FakeServer) -> None:
    fake.behaviour.actions = {0: "hang"}
    _, run = _run(fake, _trace(1), timeout_s=0.3)
    assert (run.results[0].status, run.results[0].error) == (Status.ERROR, "timeout")


def test_429_is_a_rejection_unless_retried(fake: FakeServer) -> None:
    fake.behaviour.actions = {0: "429", 1: "429"}
    _, run = _run(fake, _trace(1))
    assert run.results[0].status is Status.REJECTED and run.results[0].retries == 0
    assert len(fake.bodies) == 1

    fake.bodies.clear()
    fake.behaviour.retry_after = "0.05"
    _, run = _run(fake, _trace(1), retry_429=True)
    r = run.results[0]
    assert r.status is Status.OK and r.retries == 2 and len(fake.bodies) == 3
    assert r.ttft_s >= 0.1  # TTFT counts from the first attempt, waits included
    assert run.summary["retries_429"] == 2


def test_retry_after_beyond_the_timeout_is_a_rejection(fake: FakeServer) -> None:
    fake.behaviour.actions = {0: "429"}
    fake.behaviour.retry_after = "60"
    _, run = _run(fake, _trace(1), retry_429=True, timeout_s=5.0)
    assert run.results[0].status is Status.REJECTED and len(fake.bodies) == 1


def test_closed_loop_keeps_n_in_flight(fake: FakeServer) -> None:
    fake.behaviour.token_delay_s = 0.01
    _, run = _run(fake, _trace(9, output=5), concurrency=2)
    assert [r.index for r in run.results] == list(range(9))
    assert all(r.status is Status.OK for r in run.results)
    assert 1 <= fake.max_in_flight <= 2 and len(fake.bodies) == 9


def test_chat_with_text_prompts(fake: FakeServer, tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    _, run = _run(fake, _trace(2), api="chat", prompt_format="text",
                  tokenizer=str(tmp_path / "tok.json"))
    assert [r.status for r in run.results] == [Status.OK, Status.OK]
    content = fake.bodies[0]["messages"][0]["content"]
    assert isinstance(content, str) and len(content.split()) == 32


def test_a_model_the_endpoint_lacks_fails_before_any_load(fake: FakeServer) -> None:
    with pytest.raises(InputError, match="serves fake-model, not --model 'llama'"):
        _run(fake, _trace(2), model="llama")
    assert fake.bodies == []


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_endpoint_fails_before_any_load() -> None:
    cfg = BenchConfig(endpoint=f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(InputError, match="cannot reach --endpoint"):
        run_bench(cfg, [(None, build_workload(_trace(1), cfg))])


def test_bearer_token_from_the_environment(fake: FakeServer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fake.behaviour.api_key = "s3cret"
    with pytest.raises(InputError, match="HTTP 401 .* --api-key-env"):
        _run(fake, _trace(1))
    with pytest.raises(InputError, match="BENCH_KEY: that environment variable is not set"):
        _run(fake, _trace(1), api_key_env="BENCH_KEY")
    monkeypatch.setenv("BENCH_KEY", "s3cret")
    _, run = _run(fake, _trace(2), api_key_env="BENCH_KEY")
    assert [r.status for r in run.results] == [Status.OK, Status.OK]
    assert run.summary["completed"] == 2
