"""Prefill, decode and coupled instances as real processes (dummy model, float32): the
disaggregated output equals one in-process engine token for token, the control API answers bad
input precisely and keeps serving, reservations are refused before any prefill work, and
cancels / expiries give every block back."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq
import zmq.asyncio
from instance_procs import TINY, Reports, Result, collect, run_coupled, run_disagg

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.instance.client import InstanceClient, InstanceError
from yuebing.protocol import decode, encode
from yuebing.protocol.instance import (
    DecodeTarget,
    ErrorCode,
    ErrorReply,
    EventKind,
    Ping,
    Sampling,
    SubmitTask,
    TaskEvent,
    TaskEvents,
    TaskMode,
)

GREEDY = Sampling(max_tokens=12, temperature=0, ignore_eos=True)
rng = random.Random(7)
PROMPTS = [[rng.randrange(500) for _ in range(n)] for n in (5, 39, 300, 699)]
"""Short, one block and a bit, several store blocks, several prefill chunks of 256."""


@pytest.fixture(scope="module")
def reference():
    e = LLMEngine(EngineConfig(model=TINY, dtype="float32", threads=1, max_batch_tokens=256))
    return [o.output_token_ids for o in e.generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]


@pytest.fixture(scope="module")
def cluster(procs):
    return procs("prefill"), procs("decode"), procs("coupled")


STEP_BOUND_S = 60.0
"""Bound of a wait on a prefill chunk step (a report after it, a cancel that waits for it): a
step of a test instance starved of CPU beside other work can take tens of seconds."""


async def _clients(*procs, timeout_s: float = 5.0):
    clients, reports = [], []
    for p in procs:
        r = Reports()
        c = InstanceClient(p.address, on_report=r, timeout_s=timeout_s)
        await c.subscribe()
        clients.append(c)
        reports.append(r)
    return clients, reports


def test_disaggregated_and_coupled_outputs_equal_one_engine(cluster, reference, run):
    async def go():
        (p, d, c), reports = await _clients(*cluster)
        dr = reports[1]
        start = await dr.wait(lambda r: True)
        outs = await asyncio.gather(*[run_disagg(p, d, f"pd{i}", ids, GREEDY)
                                      for i, ids in enumerate(PROMPTS)])
        coupled = await asyncio.gather(*[run_coupled(c, f"c{i}", ids, GREEDY)
                                         for i, ids in enumerate(PROMPTS)])
        end = await dr.wait(lambda r: r.free_blocks == start.free_blocks)
        for x in (p, d, c):
            await x.close()
        assert [r.gaps for r in reports] == [0, 0, 0]  # numbered in send order
        return outs, coupled, start, end
    outs, coupled, start, end = run(go())
    for i, ref in enumerate(reference):
        assert outs[i].error == "" and outs[i].tokens == ref, i
        assert coupled[i].tokens == ref, i
        assert outs[i].finish == "length"
    # the prefill's part: first token then FINISH "handoff" with the streaming record
    hand = [e for e in outs[3].events if e.finish_reason == "handoff"][0]
    b = hand.breakdown
    assert b is not None and b.streamed_layers == 4 and b.kv_bytes > 0
    assert end.reserved_blocks == 0 and end.free_blocks == start.free_blocks


def test_layer_by_layer_streaming_and_the_asyncio_loop_give_the_same_outputs(
        cluster, procs, reference, run):
    """The default prefill sends these short chunks' KV in one batch after the last layer; one
    with ``--layerwise-min-bytes 0`` (on the standard asyncio loop) streams layer by layer."""
    layerwise = procs("prefill", "--layerwise-min-bytes", "0", "--event-loop", "asyncio")

    async def go():
        (p, lw, d), _ = await _clients(cluster[0], layerwise, cluster[1])
        whole = await asyncio.gather(*[run_disagg(p, d, f"w{i}", ids, GREEDY)
                                       for i, ids in enumerate(PROMPTS)])
        layered = await asyncio.gather(*[run_disagg(lw, d, f"l{i}", ids, GREEDY)
                                         for i, ids in enumerate(PROMPTS)])
        for x in (p, lw, d):
            await x.close()
        return whole, layered
    whole, layered = run(go())
    for i, ref in enumerate(reference):
        assert whole[i].error == "" and whole[i].tokens == ref, i
        assert layered[i].error == "" and layered[i].tokens == ref, i
    hand = [e for e in whole[3].events if e.finish_reason == "handoff"][0].breakdown
    assert hand is not None and hand.streamed_layers == 4
    assert hand.layers_before_prefill_end == 0  # every layer in the batch after the last
    hand = [e for e in layered[3].events if e.finish_reason == "handoff"][0].breakdown
    assert hand is not None and hand.streamed_layers == 4 and hand.kv_bytes > 0


def test_a_prompt_cached_but_its_last_token_counts_that_token_as_its_prefill(cluster, run):
    """A repeat of a prompt one token longer than whole blocks finds all but its last token in
    the prefill's cache and joins the decodes; that token is still its prefill in the breakdown
    (``usage.yuebing``, the access log, the prefill predictor's calibration)."""
    ids = [rng.randrange(500) for _ in range(2 * 16 + 1)]

    async def go():
        (p, d), _ = await _clients(cluster[0], cluster[1])
        cold = await run_disagg(p, d, "rep0", ids, GREEDY)
        warm = await run_disagg(p, d, "rep1", ids, GREEDY)
        for x in (p, d):
            await x.close()
        return cold, warm
    cold, warm = run(go())
    assert cold.error == warm.error == ""
    assert len(warm.tokens) == 12 and warm.tokens == cold.tokens, (cold, warm)
    first = [e for e in warm.events if e.kind == EventKind.FIRST_TOKEN][0]
    assert first.cached_tokens == 32
    hand = [[e for e in r.events if e.finish_reason == "handoff"][0].breakdown
            for r in (cold, warm)]
    assert [b.prefill_tokens for b in hand] == [33, 1]
    assert all(b.prefill_s > 0 for b in hand)
    assert all(b.prefill_threads >= 1 for b in hand)  # the threads its steps ran with


def test_bad_frames_get_precise_errors_and_the_instance_keeps_serving(cluster, run):
    prefill, decode_, _ = cluster

    async def go():
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.connect(prefill.address)
        replies = []
        for frame in (b"\x00garbage", encode(Ping(seq=5, v=99)),
                      encode(SubmitTask(seq=6, request_id="x", token_ids=[],
                                        sampling=GREEDY)),
                      encode(SubmitTask(seq=7, request_id="x", token_ids=[10**6],
                                        sampling=GREEDY)),
                      encode(SubmitTask(seq=8, request_id="y", token_ids=[1, 2],
                                        sampling=Sampling(temperature=-1))),
                      encode(SubmitTask(seq=9, request_id="z", token_ids=[1, 2],
                                        sampling=GREEDY, mode=TaskMode.PREFILL))):
            await sock.send(frame)
            replies.append(decode(await asyncio.wait_for(sock.recv(), 10)))
        await sock.send(encode(Ping(seq=10)))
        pong = decode(await asyncio.wait_for(sock.recv(), 10))
        sock.close(0)
        p, d = InstanceClient(prefill.address), InstanceClient(decode_.address)
        errors = []
        for coro in (d.reserve("big", list(range(1, 2047)) * 1, GREEDY),
                     p.submit(SubmitTask(seq=0, request_id="bad-target", token_ids=[1] * 40,
                                         sampling=GREEDY, mode=TaskMode.PREFILL,
                                         decode=DecodeTarget(instance_id="d", segment="s",
                                                             blocks=[0], layout=_layout())))):
            with pytest.raises(InstanceError) as ei:
                await coro
            errors.append(ei.value)
        await p.close()
        await d.close()
        return replies, pong, errors
    replies, pong, errors = run(go())
    assert all(isinstance(r, ErrorReply) and r.code == ErrorCode.BAD_REQUEST for r in replies)
    texts = [r.message for r in replies]
    assert "malformed message" in texts[0]
    assert "protocol version 99" in texts[1]
    assert texts[2] == "token_ids must not be empty"
    assert "token ids must be in 0..511" in texts[3]
    assert "temperature must be >= 0" in texts[4]
    assert texts[5] == "a PREFILL task needs a decode target"
    assert pong.seq == 10
    assert errors[0].code in (ErrorCode.NO_KV, ErrorCode.BAD_REQUEST)
    assert errors[1].code == ErrorCode.BAD_REQUEST and "cannot hold 40 prompt tokens" in \
        errors[1].message


def _layout():
    from yuebing.protocol.instance import KvLayout
    return KvLayout(num_layers=4, num_blocks=8, block_size=16, chunk_bytes=1, fingerprint="x")


def test_decode_refuses_before_prefill_when_kv_is_short(procs, run):
    small = procs("decode", "--num-blocks", "40", "--kv-headroom-blocks", "4")

    async def go():
        (d,), (dr,) = await _clients(small)
        first = await dr.wait(lambda r: True)
        r1 = await d.reserve("a", list(range(1, 400)), GREEDY)  # 25 blocks
        with pytest.raises(InstanceError) as ei:
            await d.reserve("b", list(range(1, 200)), GREEDY)  # 13 more: under the headroom
        mid = await dr.wait(lambda r: r.reserved_blocks == 25)
        assert await d.cancel("a")
        end = await dr.wait(lambda r: r.free_blocks == first.free_blocks, timeout_s=15)
        await d.close()
        return r1, ei.value, first, mid, end
    r1, err, first, mid, end = run(go())
    assert len(r1.target.blocks) == 25
    assert err.code == ErrorCode.NO_KV and "free blocks" in err.message
    assert mid.free_blocks == first.free_blocks - 25
    assert end.reserved_blocks == 0


def test_reservation_without_kv_expires_and_frees(procs, run):
    d_proc = procs("decode", "--reserve-timeout-s", "0.5")

    async def go():
        (d,), (dr,) = await _clients(d_proc)
        first = await dr.wait(lambda r: True)
        await d.reserve("lonely", list(range(1, 100)), GREEDY)
        res = await asyncio.wait_for(collect(d, "lonely", Result()), 10)
        end = await dr.wait(lambda r: r.free_blocks == first.free_blocks, timeout_s=15)
        await d.close()
        return res, end
    res, end = run(go())
    assert res.error == "no KV arrived for the reservation in time"
    assert end.reserved_blocks == 0


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_cancel_mid_request_frees_everything(cluster, run, when):
    prefill, decode_, _ = cluster
    long_prompt = [rng.randrange(500) for _ in range(1500)]

    async def go():
        # the prefill answers a cancel once its chunk step and KV writes are over
        (p, d), (pr, dr) = await _clients(prefill, decode_, timeout_s=STEP_BOUND_S)
        p0, d0 = await pr.wait(lambda r: True), await dr.wait(lambda r: True)
        sampling = Sampling(max_tokens=2000 - 1500 - 1, temperature=0, ignore_eos=True)
        r = await d.reserve("cx", long_prompt, sampling)
        await p.submit(SubmitTask(seq=0, request_id="cx", token_ids=long_prompt,
                                  sampling=sampling, mode=TaskMode.PREFILL, decode=r.target))
        if when == "decode":
            async for ev in p.events("cx"):
                if ev.kind >= EventKind.FINISH:
                    break
            async for ev in d.events("cx"):
                if ev.kind == EventKind.TOKENS:
                    break
        else:  # measured between steps: the first report to show it follows the first chunk
            await pr.seen(lambda r: r.queued_requests >= 1 or r.running >= 1, STEP_BOUND_S)
        await p.cancel("cx")
        await d.cancel("cx")
        pe = await pr.wait(lambda r: r.free_blocks == p0.free_blocks and r.running == 0,
                           timeout_s=STEP_BOUND_S)
        de = await dr.wait(lambda r: r.free_blocks == d0.free_blocks and r.running == 0,
                           timeout_s=STEP_BOUND_S)
        await p.close()
        await d.close()
        return pe, de
    pe, de = run(go())
    assert pe.queued_requests == 0 and de.reserved_blocks == 0
    # the cancel waited for no write stuck until its transfer timeout (STEP_BOUND_S is longer)
    assert "KV writes still in flight" not in prefill.log_path.read_text()


def test_one_step_events_travel_as_one_frame_per_connection(cluster, run):
    """Four requests decoding together on one connection: a step's tokens for all of them come
    as one `TaskEvents` frame, and every request still gets its whole ordered stream."""
    coupled = cluster[2]

    async def go():
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.connect(coupled.address)
        for i, ids in enumerate(PROMPTS[:4]):
            await sock.send(encode(SubmitTask(seq=i + 1, request_id=f"b{i}", token_ids=ids,
                                              sampling=GREEDY)))
        frames, finished = [], set()
        while len(finished) < 4:
            msg = decode(await asyncio.wait_for(sock.recv(), 60))
            frames.append(msg)
            for ev in (msg.events if isinstance(msg, TaskEvents) else
                       [msg] if isinstance(msg, TaskEvent) else []):
                if ev.kind >= EventKind.FINISH:
                    finished.add(ev.request_id)
        sock.close(0)
        return frames
    frames = run(go())
    events = [ev for m in frames for ev in (m.events if isinstance(m, TaskEvents) else
                                            [m] if isinstance(m, TaskEvent) else [])]
    batched = [m for m in frames if isinstance(m, TaskEvents)]
    assert batched and max(len(m.events) for m in batched) >= 2
    for i in range(4):
        mine = [e for e in events if e.request_id == f"b{i}"]
        assert mine[0].kind == EventKind.FIRST_TOKEN and mine[-1].kind == EventKind.FINISH
        assert sum(len(e.token_ids) for e in mine) == GREEDY.max_tokens
