"""The Conductor against fake instances speaking the real control protocol: routing, relay,
usage/breakdown, 429s, and the faults of issue 13 (dead prefill → re-dispatch once, dead decode
→ error event, client disconnect → cancel everywhere, missing heartbeats → out of the view)."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from fake_instance import FINGERPRINT, FakeInstance, FakeLoop
from harness import MODEL, ConductorThread, request, response, sse_events

from yuebing.conductor.cluster import LiveCluster
from yuebing.conductor.policy import Predictors
from yuebing.core.ids import InstanceId
from yuebing.instance.client import InstanceClient
from yuebing.instance.kvkeys import store_block_keys
from yuebing.protocol.instance import (
    Cancel,
    EventKind,
    Reserve,
    Role,
    Sampling,
    SubmitTask,
    TaskMode,
)
from yuebing.trace.latency import nearest_rank


@pytest.fixture
def fl() -> Iterator[FakeLoop]:
    loop = FakeLoop()
    yield loop
    loop.close()


P1_QUEUE = 20_000
"""Tokens a busier p1 reports queued: 2 s at the fakes' 10,000 tokens/s, so load balance picks
p0 (the Conductor ages a reported queue by the time since the report: 100 tokens, 10 ms, were
gone before a dispatch under a loaded suite, and the tie went to whichever joined first)."""


def _conductor(fl: FakeLoop, *roles: tuple[Role, str], **kw: object) -> ConductorThread:
    fakes = [fl.add(role, name, **kw.pop(f"{name}_kw", {})) for role, name in roles]  # type: ignore[arg-type]
    kw.setdefault("heartbeat_timeout_s", 2.0)  # loaded test machines stall threads for ~1 s
    c = ConductorThread(instances=tuple(f.address for f in fakes), **kw)  # type: ignore[arg-type]
    c.wait_ready()
    end = time.monotonic() + 10
    while True:  # every fake has joined and reported its load (a choice by load sees it)
        h = request(c.url, "GET", "/health")[1]
        if sum(len(v) for v in h["instances"].values()) == len(fakes) and \
                len(h["load"]) == len(fakes):
            return c
        assert time.monotonic() < end, h
        time.sleep(0.05)


def _wait_all_free(fl: FakeLoop, d0: FakeInstance, timeout_s: float) -> None:
    """Until the decode's free blocks are back at its total (else fail, naming what is held)."""
    end = time.monotonic() + timeout_s
    while fl.call(lambda: d0.free_blocks) != d0.total_blocks:
        assert time.monotonic() < end, d0.held
        time.sleep(0.02)


def _stream(c: ConductorThread, max_tokens: int) -> list:
    """Every SSE event of a streamed completion of [1, 2, 3] (read to its end)."""
    conn, resp = response(c.url, "/v1/completions", {
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True})
    try:
        return sse_events(resp)
    finally:
        conn.close()


def _complete(c: ConductorThread, **body: object) -> tuple[int, dict]:
    return request(c.url, "POST", "/v1/completions", {"model": MODEL, **body})


def test_disaggregated_stream_usage_and_metrics(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"))
    try:
        conn, resp = response(c.url, "/v1/completions", {
            "model": MODEL, "prompt": list(range(1, 41)), "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}})
        assert resp.status == 200 and resp.getheader("content-type").startswith(
            "text/event-stream")
        events = sse_events(resp)
        conn.close()
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        text = "".join(e["choices"][0]["text"] for e in chunks)
        assert text == " t1040 t1041 t1042 t1043"
        assert [e["choices"][0]["finish_reason"] for e in chunks][-1] == "length"
        usage = events[-2]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == \
            (40, 4, 44)
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        ext = usage["yuebing"]
        assert (ext["prefill_instance"], ext["decode_instance"], ext["redispatched"]) == \
            ("p0", "d0", 0)
        assert ext["queue_s"] >= 0.001 and ext["transfer_s"] == \
            pytest.approx(0.0005) and ext["decode_wait_s"] == pytest.approx(0.0002)
        assert ext["ttft_s"] > 0 and ext["tbt_s"] > 0
        est = ext["estimate"]
        assert est["prefill_s"] > 0 and est["ttft_s"] == pytest.approx(
            est["transfer_s"] + est["queue_s"] + est["prefill_s"], abs=1e-5)
        p0, d0 = fl.fakes["p0"], fl.fakes["d0"]
        (res,) = d0.kinds(Reserve)
        (task,) = p0.kinds(SubmitTask)
        assert task.mode == TaskMode.PREFILL and task.decode is not None
        assert task.decode.instance_id == "d0" and res.request_id == task.request_id
        assert fl.call(lambda: d0.free_blocks) == d0.total_blocks
        metrics = request(c.url, "GET", "/metrics")[1]
        assert 'yuebing:routed_requests_total{instance="p0",role="prefill"} 1.0' in metrics
        assert 'yuebing:routed_requests_total{instance="d0",role="decode"} 1.0' in metrics
        assert "yuebing:time_to_first_token_seconds_count 1.0" in metrics
        assert "yuebing:request_transfer_time_seconds_count 1.0" in metrics
        for phase in ("body", "parse", "start", "route", "send"):
            assert f'yuebing:conductor_dispatch_phase_seconds_count{{phase="{phase}"}} 1.0' \
                in metrics
        # non-streamed: the same text in one body
        status, body = _complete(c, prompt=list(range(1, 41)), max_tokens=4)
        assert status == 200 and body["choices"][0]["text"] == text
        assert body["choices"][0]["finish_reason"] == "length"
    finally:
        c.stop()


def test_coupled_mode_submits_once(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.COUPLED, "c0"), (Role.COUPLED, "c1"))
    try:
        status, body = _complete(c, prompt=[1, 2, 3], max_tokens=3)
        assert status == 200 and body["choices"][0]["text"] == " t1003 t1004 t1005"
        tasks = fl.fakes["c0"].kinds(SubmitTask) + fl.fakes["c1"].kinds(SubmitTask)
        assert [t.mode for t in tasks] == [TaskMode.COUPLED]
        assert not fl.fakes["c0"].kinds(Reserve) and not fl.fakes["c1"].kinds(Reserve)
        ext = body["usage"]["yuebing"]
        assert ext["prefill_instance"] == ext["decode_instance"]
    finally:
        c.stop()


def test_cache_aware_routing_and_prefix_plan(fl: FakeLoop) -> None:
    prompt = list(range(1, 600))  # two full store blocks of 256
    keys = store_block_keys(prompt, 256, FINGERPRINT)
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.DECODE, "d0"),
                   prefill_selector="global_cache_aware")
    try:
        fl.call(lambda: fl.fakes["p1"].cache.extend(keys))
        end = time.monotonic() + 15
        while len(c.conductor.cluster.index) < 2:
            assert time.monotonic() < end
            time.sleep(0.02)
        status, body = _complete(c, prompt=prompt, max_tokens=2)
        assert status == 200 and body["usage"]["yuebing"]["prefill_instance"] == "p1"
        (task,) = fl.fakes["p1"].kinds(SubmitTask)
        assert task.prefix is not None and (task.prefix.source, task.prefix.tokens) == \
            ("local", 512)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
    finally:
        c.stop()


def test_a_prefix_shared_below_a_store_block_is_estimated_from_the_engine_pages(
        fl: FakeLoop) -> None:
    """A 992-token system prompt holds three whole store blocks (768 tokens): the second user
    turn is routed to where the first was prefilled and estimated for its 50 new tokens (the
    engine keeps 16-token pages), not for the 274 past the last shared block. Pages count only
    inside the block after the held ones: before the instance reports its blocks, 240."""
    system = list(range(1, 993))
    first_prompt = system + list(range(5000, 5050))
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.DECODE, "d0"),
                   prefill_selector="global_cache_aware")
    try:
        first = _complete(c, prompt=first_prompt, max_tokens=2)[1]
        pid = first["usage"]["yuebing"]["prefill_instance"]
        early = _complete(c, prompt=system + list(range(6000, 6050)), max_tokens=2)[1]
        keys = store_block_keys(first_prompt, 256, FINGERPRINT)  # what it reports it holds
        fl.call(lambda: fl.fakes[pid].cache.extend(keys))
        end = time.monotonic() + 15
        while len(c.conductor.cluster.index) < len(keys):
            assert time.monotonic() < end
            time.sleep(0.02)
        second = _complete(c, prompt=system + list(range(7000, 7050)), max_tokens=2)[1]
        other = _complete(c, prompt=list(range(8000, 9042)), max_tokens=2)[1]
        p = c.conductor.policy
        est = [u["usage"]["yuebing"]["estimate"]["prefill_s"]
               for u in (first, early, second, other)]
        assert early["usage"]["yuebing"]["prefill_instance"] == pid
        assert second["usage"]["yuebing"]["prefill_instance"] == pid
        assert est[1] == pytest.approx(p.prefill_time(1042 - 240, 240), rel=1e-3)
        assert est[2] == pytest.approx(p.prefill_time(1042 - 992, 992), rel=1e-3)
        assert est[0] == est[3] == pytest.approx(p.prefill_time(1042, 0), rel=1e-3)
    finally:
        c.stop()


def test_reject_is_429_with_retry_after_and_health_stays_ok(
        fl: FakeLoop, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="yuebing.conductor.access")
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), admission="slo",
                   ttft_slo_s=1.0, access_log=True, p0_kw={"queued_prefill_tokens": 30_000,
                                          "prefill_tokens_per_s": 10_000.0})
    try:
        conn, resp = response(c.url, "/v1/completions",
                              {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        body = resp.read()
        conn.close()
        assert resp.status == 429, body
        assert int(resp.getheader("Retry-After")) >= 2  # ~3 s queued - 1 s SLO
        assert b'"type":"server_overloaded"' in body and b'"code":"ttft_slo"' in body
        assert not fl.fakes["p0"].kinds(SubmitTask) and not fl.fakes["d0"].kinds(Reserve)
        assert request(c.url, "GET", "/health")[0] == 200
        assert 'yuebing:rejected_requests_total{reason="ttft_slo"} 1.0' in \
            request(c.url, "GET", "/metrics")[1]
        line = next(r.getMessage() for r in caplog.records if "status=429" in r.getMessage())
        assert " finish=ttft_slo " in line  # the access log names why
    finally:
        c.stop()


def test_pool_loads_and_predictors_are_served(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), ttft_slo_s=1.0,
                   p0_kw={"queued_prefill_tokens": 30_000, "prefill_tokens_per_s": 10_000.0})
    try:
        pools = request(c.url, "GET", "/health")[1]["pools"]
        assert pools["prefill"] == pytest.approx(3.0, abs=0.3)  # 3 s queued / 1 s SLO
        assert pools["decode"] == 0.0 and pools["decode_kv"] == 0.0  # nothing running
        metrics = request(c.url, "GET", "/metrics")[1]
        line = next(x for x in metrics.splitlines()
                    if x.startswith('yuebing:pool_load{pool="prefill"}'))
        assert float(line.split()[-1]) == pytest.approx(3.0, abs=0.3)
        status, text = request(c.url, "GET", "/predictors")
        assert status == 200
        got = Predictors.from_json(json.dumps(text))
        assert got.to_json() == c.conductor.policy.predictors.to_json()
    finally:
        c.stop()


def test_decode_durations_are_learned_by_the_live_policy(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"),
                   admission="predictive_early_rejection", decode_selector="forecast")
    try:
        assert c.conductor.policy.config.decode_durations_s == (20.0,)
        for _ in range(16):
            assert _complete(c, prompt=[1, 2, 3], max_tokens=3)[0] == 200
        state = request(c.url, "GET", "/health")[1]["decode_durations"]
        assert state["in_use"] == "learned" and state["samples"] == 16
        learned = c.conductor.policy.config.decode_durations_s
        assert len(learned) == 16 and max(learned) < 5.0  # fakes decode 3 tokens in ms
    finally:
        c.stop()


def test_the_tbt_tail_is_learned_by_the_live_policy(fl: FakeLoop) -> None:
    """The fake decodes a step in 60 ms where the default predictor says 30 ms, and its
    prefill reports queued work: once 8 requests routed while the prefill was busy have
    finished, the policy's tail is the 0.9 quantile of their paper TBT per predicted step, and
    the typical ratio is about 2 (the median: a loaded machine stretches a few steps)."""
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), d0_kw={"step_s": 0.06},
                   p0_kw={"queued_prefill_tokens": 500, "prefill_tokens_per_s": 10_000.0})
    try:
        assert c.conductor.policy.config.tbt_tail == 1.0
        for _ in range(16):
            assert _complete(c, prompt=[1, 2, 3], max_tokens=4)[0] == 200
        state = request(c.url, "GET", "/health")[1]["tbt_tail"]
        assert state["learn"] and 8 <= state["samples"] <= 16  # the first, before p0's report:
        # routed with the prefill idle, not observed
        ratios = list(c.conductor.tail.window)
        assert 1.8 <= statistics.median(ratios) <= 3.0, ratios
        assert statistics.median(ratios) <= state["tail"] <= max(ratios), (state, ratios)
        assert c.conductor.policy.config.tbt_tail == pytest.approx(state["tail"], abs=1e-4)
    finally:
        c.stop()


def test_a_fresh_conductor_starts_from_the_tail_learned_on_its_configuration(
        fl: FakeLoop) -> None:
    """The tail a Conductor learned is kept (`conductor.learned`) when it stops; the next one,
    on fakes of the same configuration, predicts with it from its first request."""
    fakes = {"d0_kw": {"step_s": 0.06},
             "p0_kw": {"queued_prefill_tokens": 500, "prefill_tokens_per_s": 10_000.0}}
    a = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), **fakes)
    try:
        for _ in range(16):
            assert _complete(a, prompt=[1, 2, 3], max_tokens=4)[0] == 200
    finally:
        a.stop()  # every finished request observed, the rest written
        for name in ("p0", "d0"):  # the next fakes take their names
            fl.run(fl.fakes.pop(name).close())
    ratios = list(a.conductor.tail.window)
    assert len(ratios) >= 10 and a.conductor.policy.config.tbt_tail > 1.5
    learned = nearest_rank(ratios, 0.9)
    b = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), **fakes)
    try:
        assert b.conductor.policy.config.tbt_tail == learned
        assert list(b.conductor.tail.window) == ratios
        h = request(b.url, "GET", "/health")[1]
        assert h["tbt_tail"]["samples"] >= 8 and "tbt_tail" in h["learned"]["loaded"], h
    finally:
        b.stop()


def test_dead_prefill_before_first_token_is_redispatched_once(fl: FakeLoop) -> None:
    # a heartbeat timeout of 4 s: a loaded machine that stalls the fakes' thread for 2 s would
    # drop p0 before the request is routed (it then goes to p1 and nothing is re-dispatched)
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.DECODE, "d0"),
                   prefill_selector="load_balance", p1_kw={"queued_prefill_tokens": P1_QUEUE},
                   heartbeat_timeout_s=4.0)
    p0, p1, d0 = fl.fakes["p0"], fl.fakes["p1"], fl.fakes["d0"]
    p0.hang = True
    try:
        out: dict[str, object] = {}
        t = threading.Thread(target=lambda: out.update(r=_complete(c, prompt=[1, 2, 3],
                                                                   max_tokens=3)))
        t.start()
        end = time.monotonic() + 10
        while not p0.kinds(SubmitTask):
            assert time.monotonic() < end, ("p0 never got the task", p1.kinds(SubmitTask))
            time.sleep(0.01)
        p0.silence()  # p0 "dies" with the request in prefill
        t.join(30)
        status, body = out["r"]  # type: ignore[misc]
        assert status == 200, body
        assert body["usage"]["yuebing"]["prefill_instance"] == "p1"
        assert body["usage"]["yuebing"]["redispatched"] == 1
        assert body["choices"][0]["text"] == " t1003 t1004 t1005"
        # the first reservation was cancelled: the decode's blocks are all free again
        _wait_all_free(fl, d0, 15)
        assert len(d0.kinds(Reserve)) == 2 and len(d0.kinds(Cancel)) == 1
        health = request(c.url, "GET", "/health")[1]
        assert health["instances"]["prefill"] == ["p1"]
    finally:
        c.stop()


def test_dead_decode_ends_the_stream_with_an_error_event(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), d0_kw={"step_s": 0.02})
    fl.fakes["d0"].die_after_tokens = 2
    try:
        t0 = time.monotonic()
        events = _stream(c, max_tokens=50)
        assert time.monotonic() - t0 < 10  # heartbeat timeout 2 s + slack
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["type"] == "server_error" and "d0" in err["message"], err
        texts = [e["choices"][0]["text"] for e in events[:-2]]
        assert texts == [" t1003", " t1004", " t1005"]
        # the prefill side got its cancel (its task had ended: unknown there is fine)
        assert request(c.url, "GET", "/health")[1]["instances"]["decode"] == []
    finally:
        c.stop()


def test_a_dropped_connection_fails_streams_at_once_and_the_restart_rejoins(
        fl: FakeLoop) -> None:
    """A decode killed and restarted at its address mid-stream: its connection drops, so the
    stream ends with an error at once (not after the 30 s heartbeat timeout), and the new
    process — which the client's DEALER reaches by itself, unsubscribed — joins with its new
    incarnation before any heartbeat timeout could have noticed."""
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), d0_kw={"step_s": 0.05},
                   heartbeat_timeout_s=30.0)
    d0 = fl.fakes["d0"]
    try:
        first = c.conductor.cluster.members[InstanceId("d0")]
        old = d0.incarnation
        conn, resp = response(c.url, "/v1/completions", {
            "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "stream": True})
        assert resp.readline().startswith(b"data: ")  # the first token is out
        t0 = time.monotonic()
        fl.run(d0.restart())
        events = sse_events(resp)
        conn.close()
        assert time.monotonic() - t0 < 5
        err = events[-2]["error"]
        assert "connection to instance d0 was lost" in err["message"], err
        end = time.monotonic() + 10
        while (m := c.conductor.cluster.members.get(InstanceId("d0"))) is first \
                or m is None or not m.alive or m.report is None:
            assert time.monotonic() < end, "the restarted decode did not rejoin"
            time.sleep(0.05)
        assert m.hello.incarnation == d0.incarnation != old and first.client.closed
        status, body = _complete(c, prompt=[1, 2], max_tokens=3)
        assert status == 200 and body["usage"]["yuebing"]["decode_instance"] == "d0"
    finally:
        c.stop()


def test_a_dropped_connection_ends_each_open_stream_with_exactly_one_error(
        fl: FakeLoop) -> None:
    """Regression: a dropped link ended each open stream twice — the cluster marked the
    instance dead (``on_link`` → `_mark_dead` → `fail_all`), then the client failed its
    streams itself — and a restarted instance's first report marked it dead again: three
    ERRORs in a queue nobody had read yet. Now the cluster owns its clients' streams and
    `fail_all` ends each once; a client without ``on_link`` (used on its own) ends its
    streams itself, once. Neither queue is read here, so every ERROR stays in it."""
    d0 = fl.add(Role.COUPLED, "d0")
    d0.hang = True  # the tasks produce nothing: their streams hold only what ends them

    def task(rid: str) -> SubmitTask:
        return SubmitTask(seq=0, request_id=rid, token_ids=[1, 2, 3],
                          sampling=Sampling(max_tokens=4), mode=TaskMode.COUPLED)

    async def go() -> dict[str, list[tuple[EventKind, str]]]:
        cluster = LiveCluster(30.0, 1.0, 256, lambda _t, _q: 0.0, 1e9, 0.0)
        cluster.add(d0.address)
        plain = InstanceClient(d0.address)  # no on_link: on its own
        try:
            end = time.monotonic() + 5
            while (first := cluster.by_address.get(d0.address)) is None:
                assert time.monotonic() < end, "d0 did not join"
                await asyncio.sleep(0.01)
            await first.client.submit(task("owned"))
            await plain.submit(task("plain"))
            queues = {"owned": first.client._events["owned"], "plain": plain._events["plain"]}
            await d0.restart()
            while (m := cluster.by_address.get(d0.address)) is None or m is first \
                    or m.report is None or queues["plain"].empty():
                assert time.monotonic() < end + 5, "no drop seen, or d0 did not rejoin"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # anything more that would come
            return {rid: [(ev.kind, ev.error) for ev, _ in (q.get_nowait()
                                                           for _ in range(q.qsize()))]
                    for rid, q in queues.items()}
        finally:
            cluster.discard(d0.address)
            await plain.close()
    got = fl.run(go(), timeout_s=20)
    assert got == {
        "owned": [(EventKind.ERROR, "the connection to instance d0 was lost")],
        "plain": [(EventKind.ERROR, f"the connection to the instance at {d0.address} was "
                                    "lost")]}, got


def test_client_disconnect_cancels_on_the_instances(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), d0_kw={"step_s": 0.05})
    d0 = fl.fakes["d0"]
    try:
        conn, resp = response(c.url, "/v1/completions", {
            "model": MODEL, "prompt": list(range(100)), "max_tokens": 200, "stream": True})
        assert resp.status == 200
        resp.readline()  # the first chunk arrived
        assert fl.call(lambda: d0.free_blocks) < d0.total_blocks
        conn.sock.close()  # type: ignore[union-attr]
        conn.close()
        end = time.monotonic() + 10
        while not d0.kinds(Cancel) or fl.call(lambda: d0.free_blocks) != d0.total_blocks:
            assert time.monotonic() < end, "no cancel reached the decode"
            time.sleep(0.02)
        (cancel,) = d0.kinds(Cancel)
        assert cancel.request_id == d0.kinds(Reserve)[0].request_id
        assert c.conductor.inflight == 0
    finally:
        c.stop()


def test_missing_heartbeats_leave_the_view(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.DECODE, "d0"))
    try:
        fl.fakes["p1"].silence()
        end = time.monotonic() + 15
        while request(c.url, "GET", "/health")[1]["instances"]["prefill"] != ["p0"]:
            assert time.monotonic() < end
            time.sleep(0.05)
        for _ in range(3):  # new requests go to the live one
            status, body = _complete(c, prompt=[4, 5], max_tokens=2)
            assert status == 200 and body["usage"]["yuebing"]["prefill_instance"] == "p0"
    finally:
        c.stop()


def test_concurrency_limit_is_429(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), max_concurrent=1,
                   d0_kw={"step_s": 0.05})
    try:
        conn, resp = response(c.url, "/v1/completions", {
            "model": MODEL, "prompt": [1, 2], "max_tokens": 40, "stream": True})
        resp.readline()
        status, body = _complete(c, prompt=[1, 2], max_tokens=2)
        assert status == 429 and body["error"]["code"] == "too_many_requests"
        sse_events(resp)
        conn.close()
        assert _complete(c, prompt=[1, 2], max_tokens=2)[0] == 200
    finally:
        c.stop()


def test_a_restarted_instance_rejoins_with_its_new_incarnation(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"))
    p0 = fl.fakes["p0"]
    try:
        first = c.conductor.cluster.members[InstanceId("p0")]
        p0.silence()
        end = time.monotonic() + 15
        while request(c.url, "GET", "/health")[1]["instances"]["prefill"]:
            assert time.monotonic() < end
            time.sleep(0.05)

        def restart() -> None:  # same address, a new process: new incarnation, no subscribers
            p0.incarnation = uuid.uuid4().hex
            p0.subscribers.clear()
            p0.silent = False
        fl.call(restart)
        end = time.monotonic() + 15
        while request(c.url, "GET", "/health")[1]["instances"]["prefill"] != ["p0"]:
            assert time.monotonic() < end, "the restarted instance did not rejoin"
            time.sleep(0.05)
        member = c.conductor.cluster.members[InstanceId("p0")]
        assert member is not first and member.hello.incarnation == p0.incarnation
        assert first.client.closed
        status, body = _complete(c, prompt=[1, 2], max_tokens=2)
        assert status == 200 and body["usage"]["yuebing"]["prefill_instance"] == "p0"
    finally:
        c.stop()


def test_prefill_death_between_first_token_and_handoff_fails_the_stream(fl: FakeLoop) -> None:
    """The first token reached the client but the KV never reached the decode: the stream ends
    with an error (it used to wait on the decode until the request timeout) and the decode's
    reservation is cancelled."""
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"))
    p0, d0 = fl.fakes["p0"], fl.fakes["d0"]
    p0.die_before_handoff = True
    try:
        t0 = time.monotonic()
        events = _stream(c, max_tokens=20)
        assert time.monotonic() - t0 < 15
        assert events[0]["choices"][0]["text"] == " t1003"
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "prefill_failed"
        _wait_all_free(fl, d0, 15)
        assert d0.kinds(Cancel)
    finally:
        c.stop()


def test_request_timeout_ends_a_hung_prefill(fl: FakeLoop) -> None:
    """A prefill that never produces the first token (but keeps reporting): the request's
    timer ends it with ``timeout`` at ``request_timeout_s``, and its decode reservation is
    cancelled."""
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), request_timeout_s=1.0)
    p0, d0 = fl.fakes["p0"], fl.fakes["d0"]
    p0.hang = True
    try:
        t0 = time.monotonic()
        status, body = _complete(c, prompt=[1, 2, 3], max_tokens=3)
        assert 0.9 < time.monotonic() - t0 < 8
        assert status == 500 and body["error"]["code"] == "timeout", body
        _wait_all_free(fl, d0, 15)
    finally:
        c.stop()


def test_request_timeout_ends_a_slow_decode_stream(fl: FakeLoop) -> None:
    """The deadline passes while the decode streams (after the prefill's hand-off): the stream
    ends with a ``timeout`` error event, not a ``prefill_failed`` one."""
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), request_timeout_s=1.5,
                   d0_kw={"step_s": 0.2})
    try:
        t0 = time.monotonic()
        events = _stream(c, max_tokens=100)
        assert 1.4 < time.monotonic() - t0 < 8
        assert events[0]["choices"][0]["text"] == " t1003"
        assert len(events) > 4  # tokens of the decode reached the client first
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout", events[-2]
    finally:
        c.stop()


def test_a_call_pending_on_an_instance_that_dies_fails_at_the_heartbeat_timeout(
        fl: FakeLoop) -> None:
    """A submit that the dying prefill never acknowledges is re-dispatched once the instance
    is found dead (heartbeat timeout, 2 s), not after the RPC timeout (30 s here)."""
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.DECODE, "d0"),
                   prefill_selector="load_balance", rpc_timeout_s=30.0,
                   p1_kw={"queued_prefill_tokens": P1_QUEUE})
    try:  # p0 dies as the submit arrives: silencing it before could let the heartbeat
        # find it dead before dispatch on a stalled machine, and p1 would be picked first
        fl.call(lambda: setattr(fl.fakes["p0"], "die_on_submit", True))
        t0 = time.monotonic()
        status, body = _complete(c, prompt=[1, 2, 3], max_tokens=2)
        assert status == 200, body
        assert fl.fakes["p0"].kinds(SubmitTask)
        assert body["usage"]["yuebing"]["prefill_instance"] == "p1"
        assert body["usage"]["yuebing"]["redispatched"] == 1
        assert time.monotonic() - t0 < 15
    finally:
        c.stop()


def test_decode_kv_is_reserved_when_the_prefill_turn_comes_not_at_dispatch(
        fl: FakeLoop) -> None:
    """Four requests at once, a prefill that takes them one at a time (gate of 100 tokens) and
    a decode with KV for only two prompts: none is refused. Each reservation is made when the
    request's prefill turn comes, so queued requests hold no decode KV; one that finds the
    decode full waits for blocks instead of getting a 429."""
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), prefill_gate_tokens=100,
                   p0_kw={"prefill_delay_s": 0.2}, d0_kw={"total_blocks": 12, "step_s": 0.05})
    p0, d0 = fl.fakes["p0"], fl.fakes["d0"]
    try:
        out: dict[int, tuple[int, dict]] = {}
        threads = [threading.Thread(target=lambda i=i: out.update(
            {i: _complete(c, prompt=list(range(1, 81)), max_tokens=6)})) for i in range(4)]
        for t in threads:
            t.start()
        end = time.monotonic() + 5
        while not p0.kinds(SubmitTask):
            assert time.monotonic() < end
            time.sleep(0.01)
        gate = c.conductor.cluster.alive(Role.PREFILL)[0].gate
        while gate.waiting < 3:  # the first prefill runs; the other three wait in the Conductor
            assert time.monotonic() < end, gate.waiting
            time.sleep(0.01)
        assert len(d0.kinds(Reserve)) == 1
        for t in threads:
            t.join(30)
        assert sorted(s for s, _ in out.values()) == [200] * 4, out
        assert p0.max_prefilling == 1
        body = out[0][1]
        assert body["usage"]["yuebing"]["queue_s"] >= 0
        health = request(c.url, "GET", "/health")[1]
        assert health["status"] == "ok"
        _wait_all_free(fl, d0, 10)
    finally:
        c.stop()


def test_a_decode_that_stays_full_refuses_with_429_after_reserve_wait(fl: FakeLoop) -> None:
    c = _conductor(fl, (Role.PREFILL, "p0"), (Role.DECODE, "d0"), reserve_wait_s=0.3,
                   d0_kw={"total_blocks": 4})
    d0 = fl.fakes["d0"]
    try:
        fl.call(lambda: setattr(d0, "free_blocks", 0))  # another Conductor's requests hold it
        status, body = _complete(c, prompt=list(range(1, 33)), max_tokens=2)
        assert status == 429, body
        assert body["error"]["code"] == "decode_kv_full"
        assert len(d0.kinds(Reserve)) >= 2        # retried before giving up
        assert not fl.fakes["p0"].kinds(SubmitTask)
    finally:
        c.stop()
