"""Engine settings out of range (issue 15 item 18): a precise error (exit 2 from the CLI),
never a silent clamp, an OverflowError or an allocation traceback."""

from __future__ import annotations

import pytest
from engine_factories import TINY, make_engine

from yuebing.cli.main import main
from yuebing.core.errors import ConfigError, InputError
from yuebing.engine.config import EngineConfig
from yuebing.engine.sampling import SamplingParams


def test_max_model_len_past_the_models_context(tiny_weights):
    with pytest.raises(ConfigError) as exc:
        make_engine(tiny_weights, max_model_len=1_000_000)
    assert "max_model_len 1000000 exceeds the context of model" in str(exc.value)
    assert "(512 tokens); give at most 512, or 0 for the model's own" in str(exc.value)
    assert make_engine(tiny_weights, max_model_len=512, num_blocks=128).max_model_len == 512


@pytest.mark.parametrize("kw,msg", [
    (dict(num_blocks=10**20), "num_blocks must be in 0..2147483647"),
    (dict(threads=10**20), "threads must be in 0..4096"),
    (dict(weights_seed=10**20), "weights_seed must be in 0..9223372036854775807"),
])
def test_config_numbers_out_of_range(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        EngineConfig(**kw)


def test_kv_pool_too_big_to_address_or_allocate(tiny_weights):
    with pytest.raises(ConfigError, match="is past the 2147483647 that int32 block tables"):
        make_engine(tiny_weights, num_blocks=0, kv_cache_bytes=10**20)
    with pytest.raises(ConfigError, match=r"cannot allocate a KV pool of \d+ blocks"):
        make_engine(tiny_weights, num_blocks=2**31 - 1, block_size=4096)


def test_sampling_seed_out_of_range():
    with pytest.raises(InputError, match="seed must be an integer in"):
        SamplingParams(seed=10**20, temperature=1.0)


@pytest.mark.parametrize("argv,msg", [
    (["--max-model-len", "1000000"], "max_model_len 1000000 exceeds the context of model"),
    (["--num-blocks", str(10**20)], "num_blocks must be in 0..2147483647"),
    (["--kv-cache-bytes", str(10**20)], "int32 block tables address"),
])
def test_generate_cli_exits_2(capsys, argv, msg):
    assert main(["generate", "hi", "--model", TINY, "--dtype", "float32", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err
