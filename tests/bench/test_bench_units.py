"""Load generator pieces without a server: SSE parsing, Retry-After, per-request metrics, the
aggregates, the workload (block scaling, caps, prefix sharing, send times) and the config."""

from __future__ import annotations

import email.utils
import math

import numpy as np
import pytest

from yuebing.bench.client import SSEParser, request_body, retry_after_s
from yuebing.bench.config import BenchConfig
from yuebing.bench.metrics import attainment, max_sustained_rate, summarize
from yuebing.bench.result import RequestResult, Status
from yuebing.bench.workload import build_workload, scaled_request, send_times
from yuebing.core.errors import ConfigError, InputError
from yuebing.trace.latency import tbt_summary
from yuebing.trace.model import Request, Trace

# --- SSE and Retry-After --------------------------------------------------------------------


def test_sse_parser_joins_data_lines_and_skips_other_fields() -> None:
    p = SSEParser()
    lines = [b": keep-alive\n", b"event: chunk\n", b"data: {\"a\":\n", b"data:1}\r\n", b"\r\n",
             b"\n", b"id: 7\n", b"data: [DONE]\n"]
    events = [e for e in (p.feed(line) for line in lines) if e is not None]
    assert events == ['{"a":\n1}']
    assert p.flush() == "[DONE]"
    assert p.flush() is None


def test_retry_after_seconds_date_and_fallback() -> None:
    assert retry_after_s("3") == 3.0
    assert retry_after_s("0.25") == 0.25
    assert retry_after_s("-4") == 0.0
    assert retry_after_s(None) == 1.0
    assert retry_after_s("soon") == 1.0
    date = email.utils.formatdate(1_000_010.0, usegmt=True)
    assert retry_after_s(date, now=1_000_000.0) == 10.0


@pytest.mark.parametrize(("event", "error", "detail"), [
    ('{"error": {"message": "engine died"}}', "stream_error", "engine died"),
    ('{"object": "error", "message": "too long", "code": 400}', "stream_error", "too long"),
    ("[1, 2]", "bad_response", "not a JSON object"),
    ("{oops", "bad_response", "not JSON"),
])
def test_error_events(event: str, error: str, detail: str) -> None:
    from yuebing.bench.client import StreamReader

    r = RequestResult(0, 0.0, 1, 1)
    assert StreamReader(r, "completions").event(event, 1.0) is False
    assert r.error == error and detail in r.detail


def test_output_events_usage_and_null_fields() -> None:
    from yuebing.bench.client import StreamReader

    r = RequestResult(0, 0.0, 1, 1)
    chunk = '{"choices": [{"index": 0, "text": " Paris", "finish_reason": null}], "usage": null}'
    assert StreamReader(r, "completions").event(chunk, 0.5)
    assert StreamReader(r, "chat").event(
        '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}',
        0.6)  # a role-only chat chunk is no token
    usage = ('{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, '
             '"prompt_tokens_details": null}}')
    assert StreamReader(r, "completions").event(usage, 0.7)
    assert r.token_times_s == [0.5] and (r.prompt_tokens, r.output_tokens) == (9, 3)
    assert r.cached_tokens is None


@pytest.mark.parametrize(("api", "events", "done", "judged"), [
    # empty text per token + usage: ok, timed by the output chunks (not chat's role chunk)
    ("completions", ['{"choices": [{"text": ""}]}'] * 2
     + ['{"choices": [], "usage": {"completion_tokens": 2}}'], True, ("ok", 2, [0, 1])),
    ("chat", ['{"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
              '{"choices": [{"delta": {"content": ""}}]}',
              '{"choices": [], "usage": {"completion_tokens": 1}}'], True, ("ok", 1, [1])),
    # token ids count and time tokens without text or usage
    ("completions", ['{"choices": [{"text": "", "token_ids": [5, 6]}]}'], True,
     ("ok", 2, [0])),
    # empty text and nothing counting tokens; or no [DONE]
    ("completions", ['{"choices": [{"text": ""}]}'], True, ("no_tokens", 0, [])),
    ("completions", ['{"choices": [{"text": "a"}]}'], False, ("incomplete", 0, [0])),
])
def test_stream_judged_by_completion_and_token_counts(
        api: str, events: list[str], done: bool, judged: tuple[str, int, list[int]]) -> None:
    from yuebing.bench.client import StreamReader

    r = RequestResult(0, 0.0, 1, 1)
    reader = StreamReader(r, api)
    for t, data in enumerate(events):
        assert reader.event(data, float(t))
    reader.end(done)
    assert (r.error or str(r.status), r.output_tokens, r.token_times_s) == judged


# --- per-request metrics --------------------------------------------------------------------


def _ok(index: int, start: float, times: list[float], out: int | None = None) -> RequestResult:
    r = RequestResult(index, start, 100, len(times))
    r.start_s = start
    r.token_times_s = list(times)
    r.status = Status.OK
    r.output_tokens = out if out is not None else len(times)
    r.finish(times[-1] + 0.001)
    return r


def _failed(index: int, status: Status, error: str) -> RequestResult:
    r = RequestResult(index, 0.0, 100, 10)
    r.start_s = 0.0
    r.fail(status, error)
    r.finish(0.5)
    return r


def test_request_metrics_use_the_papers_tbt() -> None:
    times = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 2.4]  # 10 intervals, one slow
    r = _ok(0, 0.25, times)
    assert r.ttft_s == pytest.approx(0.25)
    tbt, p90, mean = tbt_summary(np.diff(times))
    assert (r.tbt_s, r.itl_p90_s, r.itl_mean_s) == (tbt, p90, mean)
    assert r.tbt_s == pytest.approx(1.0)  # the longest ceil(10 %) = 1 interval
    assert r.e2e_s == pytest.approx(2.401 - 0.25)
    assert r.meets(0.3, 1.0) and not r.meets(0.2, 1.0) and not r.meets(0.3, 0.99)


def test_the_simulator_and_the_bench_share_one_tbt_definition() -> None:
    import yuebing.bench.result as bench_result
    import yuebing.sim.metrics as sim_metrics

    assert sim_metrics.tbt_summary is tbt_summary
    assert bench_result.tbt_summary is tbt_summary


def test_the_first_failure_is_kept() -> None:
    r = RequestResult(0, 0.0, 1, 1)
    r.fail(Status.ERROR, "stream_error", "engine died")
    r.fail(Status.ERROR, "incomplete")
    assert (r.status, r.error, r.detail) == (Status.ERROR, "stream_error", "engine died")
    r.finish(1.0)
    assert math.isnan(r.ttft_s) and not r.meets(1e9, 1e9)


def test_record_json_has_no_nan() -> None:
    rec = _failed(3, Status.REJECTED, "rejected").to_json()
    assert rec["status"] == "rejected" and rec["ttft_s"] is None and rec["chunks"] == 0


# --- aggregates -----------------------------------------------------------------------------


def _cfg(**kw: object) -> BenchConfig:
    return BenchConfig(**kw)  # type: ignore[arg-type]


def test_summary_attainment_goodput_errors_and_cache() -> None:
    fast = _ok(0, 0.0, [0.1, 0.15, 0.2])  # TTFT 0.1, TBT 0.05
    slow = _ok(1, 1.0, [1.1, 1.4, 1.7])  # TTFT 0.1, TBT 0.3
    late = _ok(2, 0.0, [2.0, 2.05, 2.1])  # TTFT 2.0, TBT 0.05
    fast.prompt_tokens, fast.cached_tokens = 100, 64
    slow.prompt_tokens, slow.cached_tokens = 100, 0
    results = [fast, slow, late, _failed(3, Status.REJECTED, "rejected"),
               _failed(4, Status.ERROR, "http_500"), _failed(5, Status.ERROR, "http_500"),
               _failed(6, Status.ERROR, "timeout")]
    cfg = _cfg(slo_ttft=(1.0, 5.0), slo_tbt=(0.1, 0.5))
    s = summarize(results, cfg)
    assert (s["requests"], s["completed"], s["rejected"], s["errors"]) == (7, 3, 1, 3)
    assert s["errors_by_kind"] == {"http_500": 2, "timeout": 1}
    grid = {(row["ttft_s"], row["tbt_s"]): row["attainment"] for row in s["slo"]}
    assert grid == {(1.0, 0.1): 1 / 7, (1.0, 0.5): 2 / 7, (5.0, 0.1): 2 / 7, (5.0, 0.5): 3 / 7}
    assert s["attainment"] == 1 / 7 == attainment(results, 1.0, 0.1)
    assert s["capacity"] == {"100": 1 / 7, "500": 2 / 7}
    assert s["duration_s"] == pytest.approx(2.101)
    assert s["goodput_rps"] == pytest.approx(1 / 2.101)
    assert s["goodput_tokens_per_s"] == pytest.approx(3 / 2.101)
    assert s["tokens"]["cached"] == 64 and s["tokens"]["cached_share"] == pytest.approx(0.32)
    assert s["tokens"]["cached_reported_by"] == 2 and s["tokens"]["output"] == 9
    assert s["ttft_s"]["p50"] == pytest.approx(0.1)


def test_max_sustained_rate() -> None:
    sweep = [(1.0, {"attainment": 1.0}), (2.0, {"attainment": 0.9}),
             (4.0, {"attainment": 0.5})]
    assert max_sustained_rate(sweep, 0.9) == 2.0
    assert max_sustained_rate(sweep, 0.95) == 1.0
    assert max_sustained_rate(sweep[2:], 0.9) is None


# --- workload -------------------------------------------------------------------------------


def test_block_scaling_and_caps_keep_prefixes() -> None:
    r = Request(0, 1000, 300, (7, 8))
    assert scaled_request(r, 512, _cfg(block_tokens=64)) == Request(0, 125, 300, (7, 8))
    assert scaled_request(r, 512, _cfg(block_tokens=64, max_input=100, max_output=128)) == \
        Request(0, 100, 128, (7, 8))
    assert scaled_request(r, 512, _cfg(block_tokens=64, max_input=50)) == Request(0, 50, 300, (7,))
    assert scaled_request(Request(0, 10, 0, (1,)), 512, _cfg()).output_length == 1


def test_shared_hash_ids_become_shared_token_prefixes() -> None:
    trace = Trace((Request(0, 1024, 4, (1, 2)), Request(5, 1024, 4, (1, 3)),
                   Request(9, 1000, 4, (4,))))
    reqs = build_workload(trace, _cfg(block_tokens=16))
    a, b, c = (list(r.prompt) for r in reqs)  # type: ignore[arg-type]
    assert [len(a), len(b), len(c)] == [32, 32, 32]
    assert a[:16] == b[:16] and a[16:] != b[16:]
    assert c[:16] != a[:16] and c[16:] != a[16:]  # an id the trace does not list is unique
    assert [r.max_tokens for r in reqs] == [4, 4, 4]


def test_send_times_limit_speed_and_poisson() -> None:
    trace = Trace(tuple(Request(t, 10, 1, ()) for t in (3000, 1000, 2000, 5000)))
    reqs = build_workload(trace, _cfg(speed=2.0, limit=3))
    assert [r.send_s for r in reqs] == [0.0, 0.5, 1.0]
    poisson = send_times([Request(0, 1, 1, ())] * 4, _cfg(seed=3), rate=2.0)
    assert poisson[0] == 0.0 and poisson == sorted(poisson)
    assert poisson == send_times([Request(9, 1, 1, ())] * 4, _cfg(seed=3), rate=2.0)


def test_each_sweep_run_has_its_own_prompts_with_the_same_sharing() -> None:
    from yuebing.bench.workload import sweep_workloads

    trace = Trace(tuple(Request(t, 600, 2, (t % 2,)) for t in range(4)))
    (r1, w1), (r2, w2) = sweep_workloads(trace, _cfg(block_tokens=16, seed=7), None, [1.0, 4.0])
    assert (r1, r2) == (1.0, 4.0)
    assert not {r.prompt[:16] for r in w1} & {r.prompt[:16] for r in w2}
    for w in (w1, w2):
        assert w[0].prompt[:16] == w[2].prompt[:16] != w[1].prompt[:16] == w[3].prompt[:16]
    assert [r.send_s for r in w2] == send_times([Request(0, 1, 1, ())] * 4, _cfg(seed=7), 4.0)


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(InputError, match="request 1 .* empty prompt"):
        build_workload(Trace((Request(0, 5, 1, ()), Request(1, 0, 1, ()))), _cfg())


def _word_tokenizer(path: str, size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(path)


def test_text_prompts_decode_the_token_ids(tmp_path) -> None:
    path = str(tmp_path / "tokenizer.json")
    _word_tokenizer(path, 200)
    trace = Trace((Request(0, 768, 1, (1, 2)), Request(1, 768, 1, (1, 5))))  # 24 tokens
    cfg = _cfg(prompt_format="text", tokenizer=path, block_tokens=16)
    from yuebing.trace.prompts import PromptSynthesizer

    synth = PromptSynthesizer(low=10, high=200)
    a, b = (r.prompt for r in build_workload(trace, cfg, synth))
    assert isinstance(a, str) and len(a.split()) == 24
    assert a.split()[:16] == b.split()[:16] and a.split()[16:] != b.split()[16:]
    with pytest.raises(InputError, match="has 200 tokens but prompts use ids up to"):
        build_workload(trace, cfg)  # default ids reach 29999
    with pytest.raises(InputError, match="no such file"):
        build_workload(trace, _cfg(prompt_format="text", tokenizer=str(tmp_path / "nope")))


def test_request_bodies() -> None:
    from yuebing.bench.workload import BenchRequest

    body = request_body(BenchRequest(0, 0.0, (5, 6), 2, 9), _cfg(), "m")
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 9 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    chat = request_body(BenchRequest(0, 0.0, "hi there", 2, 3),
                        _cfg(api="chat", prompt_format="text", tokenizer="t.json",
                             ignore_eos=False), "m")
    assert chat["messages"] == [{"role": "user", "content": "hi there"}]
    assert "prompt" not in chat and "ignore_eos" not in chat


@pytest.mark.parametrize(("kw", "message"), [
    ({"endpoint": "127.0.0.1:8000"}, "must be an http"),
    ({"api": "embeddings"}, "--api must be one of"),
    ({"api": "chat"}, "chat messages are text"),
    ({"prompt_format": "text"}, "needs --tokenizer"),
    ({"rate": 1.0, "concurrency": 2}, "exclude each other"),
    ({"rate": 1.0, "speed": 2.0}, "--speed scales the trace's own timestamps"),
    ({"concurrency": 4, "speed": 2.0}, "--speed scales the trace's own timestamps"),
    ({"slo_tbt": ()}, "at least one threshold"),
    ({"slo_ttft": (0.0,)}, "must be > 0 seconds"),
    ({"speed": 0.0}, "--speed must be > 0"),
    ({"max_input": -1}, "--max-input must be >= 0"),
    ({"block_tokens": 0}, "--block-tokens must be >= 1"),
    ({"target_attainment": 1.5}, "--target-attainment"),
])
def test_bad_config_is_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(**kw)


def test_base_url_drops_v1() -> None:
    assert _cfg(endpoint="http://h:1/v1/").base_url == "http://h:1"
    assert _cfg(endpoint="http://h:1").base_url == "http://h:1"


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n)


def test_conversation_trace_prefixes_follow_hash_ids(conversation_trace) -> None:
    """On the released trace, two prompts share exactly (leading equal hash ids) × block
    tokens, cut to the shorter prompt: the sharing a server's prefix cache will see."""
    from yuebing.trace.io import load_trace

    trace = load_trace(conversation_trace)
    cfg = _cfg(block_tokens=64, max_input=4096, limit=300)
    reqs = build_workload(trace, cfg)
    scaled = [scaled_request(r, 512, cfg) for r in trace.in_time_order()[:300]]
    by_first: dict[int, list[int]] = {}
    for i, r in enumerate(scaled):
        if r.hash_ids:
            by_first.setdefault(r.hash_ids[0], []).append(i)
    pairs = 0
    for group in by_first.values():
        for a, b in zip(group, group[1:], strict=False):
            pa, pb = reqs[a].prompt, reqs[b].prompt
            expected = min(_common(scaled[a].hash_ids, scaled[b].hash_ids) * 64,
                           len(pa), len(pb))
            common = _common(pa, pb)  # type: ignore[arg-type]
            assert common == expected, (a, b)
            pairs += 1
    assert pairs > 10 and max(len(r.prompt) for r in reqs) == 4096


def test_open_files_limit_is_raised_to_the_hard_limit() -> None:
    import resource

    from yuebing.bench.runner import raise_open_files_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 64:
        pytest.skip("no finite hard limit to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        assert raise_open_files_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- runs cut short (--stop-when-decided) ---------------------------------------------------


def test_ctrl_c_right_after_the_cut_leaves_no_request_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from yuebing.bench import runner
    from yuebing.bench.workload import BenchRequest

    finished: list[int] = []

    async def fake_send(session, req, cfg, model, clock) -> RequestResult:  # type: ignore[no-untyped-def]
        res = RequestResult(req.index, req.send_s, 1, 1)
        if req.index:  # every request but the first is slow
            await asyncio.sleep(0.5)  # a slow request (the fake's behaviour)
        res.fail(Status.ERROR, "http_500")  # a miss: one of eight already decides the run
        finished.append(req.index)
        return res

    monkeypatch.setattr(runner, "send", fake_send)
    cfg = _cfg(stop_when_decided=True)
    requests = [BenchRequest(i, 0.0 if i < 4 else 0.01 * i, (1,), 1, 1) for i in range(8)]

    async def main(steps: int) -> list[RequestResult]:
        done: list[RequestResult] = []
        decider = runner.Decider(cfg, len(requests))
        task = asyncio.create_task(runner.open_loop(None, requests, cfg, "m",  # type: ignore[arg-type]
                                                    done, None, decider))
        while not decider.missed_for_certain:
            await asyncio.sleep(0)
        for _ in range(steps):  # Ctrl-C lands somewhere in open_loop's clean-up after the cut
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not left, left  # no request left running after the cut
        return done

    for steps in range(6):
        finished.clear()
        done = asyncio.run(main(steps))
        assert finished == [0] and [r.index for r in done] == [0], steps


def test_a_cut_short_summary_bounds_every_attainment() -> None:
    from yuebing.bench.runner import bound_summary

    cfg = _cfg(slo_ttft=(10.0,), slo_tbt=(0.1, 0.3))
    ok = RequestResult(0, 0.0, 1, 2, start_s=0.0, status=Status.OK, token_times_s=[1.0, 1.2])
    ok.finish(1.2)  # TBT 0.2 s: meets 300 ms, misses 100 ms
    bad = RequestResult(1, 0.0, 1, 2)
    bad.fail(Status.ERROR, "http_500")
    bad.finish(0.5)
    out = bound_summary(summarize([ok, bad], cfg), [ok, bad], total=10, misses=2)
    assert out["attainment"] == 0.8 and out["capacity"] == {"100": 0.8, "300": 0.9}
    assert [row["attainment"] for row in out["slo"]] == [0.8, 0.9]
    assert out["cut_short"] == {"answered": 2, "of": 10, "missed": 2, "attainment_at_most": 0.8}
    assert out["requests"] == 2 and out["completed"] == 1  # counts stay the answered ones
