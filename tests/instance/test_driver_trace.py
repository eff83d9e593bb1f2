"""EngineDriver's step trace: one JSON line per engine step, written by the driver thread."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.sequence import RequestOutput
from yuebing.instance.driver import EngineDriver

TINY = "dummy:preset=tiny,vocab=512,layers=2,hidden=64,heads=4,kv_heads=2,ffn=64,ctx=4096,tie=0"


def test_each_step_is_one_line_with_its_batch(tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig(model=TINY, dtype="float32", threads=1, num_blocks=64))
    finished = threading.Event()

    def outputs(outs: list[RequestOutput]) -> None:
        if any(o.finished for o in outs):
            finished.set()

    trace = tmp_path / "steps" / "d0.steps.jsonl"
    driver = EngineDriver(engine, outputs, step_trace=trace)
    driver.call(lambda e: e.add_request(list(range(40)), SamplingParams(max_tokens=4,
                                                                         ignore_eos=True)))
    assert finished.wait(30)
    deadline = time.monotonic() + 30  # each line is there while the driver runs (a killed
    while len(trace.read_text().splitlines()) < 4 and time.monotonic() < deadline:  # instance
        time.sleep(0.01)  # loses none)
    assert len(trace.read_text().splitlines()) == 4
    driver.close()
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    # 40 prompt tokens in one chunk (it yields the first token), then three decode steps whose
    # context grows by one token each
    assert [(s["prefill_tokens"], s["decodes"]) for s in steps] == [(40, 0)] + [(0, 1)] * 3
    assert [s["context_tokens"] for s in steps[1:]] == [41, 42, 43]
    assert all(0 < s["step_s"] <= s["out_s"] for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)


def test_a_chunked_prompt_s_steps_say_what_each_chunk_attended_over(tmp_path: Path) -> None:
    """A long prompt's chunks (``max_batch_tokens`` each) carry the tokens before them, so
    their step times can be set beside a profile's (new, cached) prediction (cpp_sim_vs_live)."""
    engine = LLMEngine(EngineConfig(model=TINY, dtype="float32", threads=1, num_blocks=64,
                                    max_batch_tokens=32, max_num_seqs=4))
    finished = threading.Event()
    trace = tmp_path / "p0.steps.jsonl"
    driver = EngineDriver(engine, lambda outs: finished.set() if any(o.finished for o in outs)
                          else None, step_trace=trace)
    driver.call(lambda e: e.add_request(list(range(100)), SamplingParams(max_tokens=1)))
    assert finished.wait(30)
    driver.close()
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(s["prefill_tokens"], s["prefill_cached_tokens"]) for s in steps] == \
        [(32, 0), (32, 32), (32, 64), (4, 96)]


def test_a_step_trace_dir_that_cannot_be_written_is_refused_by_the_config(tmp_path: Path) -> None:
    import pytest

    from yuebing.core.errors import ConfigError
    from yuebing.instance.config import InstanceConfig

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="is not a writable directory"):
        InstanceConfig(role="decode", step_trace_dir=str(blocker / "steps"))
    assert InstanceConfig(role="decode", step_trace_dir=str(tmp_path / "new" / "dir"))


def test_mean_threads_weighs_each_step_by_its_time() -> None:
    """What a prefill ran with (`Breakdown.prefill_threads`): 1 s on 1 thread and 3 s on 2
    since the mark is 1.75 threads; a mark with nothing after it is 0."""
    engine = LLMEngine(EngineConfig(model=TINY, dtype="float32", threads=1, num_blocks=64))
    driver = EngineDriver(engine, lambda outs: None)
    try:
        driver.stats.record(5.0, 10, 0, threads=4)  # before the mark: not counted
        mark = driver.marks()
        assert driver.mean_threads(mark) == 0.0
        driver.stats.record(1.0, 10, 0, threads=1)
        driver.stats.record(3.0, 10, 0, threads=2)
        assert driver.mean_threads(mark) == 1.75
    finally:
        driver.close()
