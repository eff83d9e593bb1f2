"""Bad input gets a clear error and changes nothing."""

from __future__ import annotations

import pytest
from engine_factories import make_engine

from yuebing.cli.main import main
from yuebing.core.errors import ConfigError, InputError
from yuebing.engine.config import EngineConfig
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.weights import load_weights, parse_dummy_spec


def test_unknown_model_path():
    with pytest.raises(InputError, match=r"model '/nope/model.gguf' not found"):
        load_weights("/nope/model.gguf")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(InputError, match="not a readable GGUF file"):
        load_weights(str(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"hello world, not a model")
    with pytest.raises(InputError, match="not a readable GGUF file"):
        load_weights(str(junk))


def test_bad_hf_dir(tmp_path):
    with pytest.raises(InputError, match="no config.json"):
        load_weights(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(InputError, match="model_type 'gpt2' is not supported"):
        load_weights(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(InputError, match="invalid model config \\(missing key "
                                         "'num_attention_heads'\\)"):
        load_weights(str(tmp_path))


def test_bad_dummy_spec():
    with pytest.raises(InputError, match="unknown dummy model key 'depth'"):
        parse_dummy_spec("dummy:depth=3")
    with pytest.raises(InputError, match="must be a multiple of num_kv_heads"):
        parse_dummy_spec("dummy:preset=tiny,heads=4,kv_heads=3")


def test_prompt_longer_than_context(tiny_weights):
    engine = make_engine(tiny_weights, max_model_len=32)
    with pytest.raises(InputError) as exc:
        engine.add_request(list(range(40)))
    assert str(exc.value) == ("the prompt has 40 tokens but the context holds 32 "
                              "(prompt + output); shorten the prompt")
    small = make_engine(tiny_weights, num_blocks=5, block_size=4)  # 20 tokens of KV
    with pytest.raises(InputError) as exc:
        small.add_request(list(range(20)))
    assert str(exc.value) == ("the prompt has 20 tokens but the context holds 20 "
                              "(prompt + output); the KV pool of 5 blocks of 4 tokens bounds "
                              "it; raise num_blocks / kv_cache_bytes or shorten the prompt")
    with pytest.raises(InputError, match="prompt token ids must be integers in 0..255"):
        engine.add_request([1, 2, 999])
    with pytest.raises(InputError, match="the prompt is empty"):
        engine.add_request([])
    with pytest.raises(InputError, match="has no tokenizer"):
        engine.add_request("text for a model without tokenizer")
    assert not engine.has_unfinished() and engine.allocator.num_free == 64


def test_negative_max_tokens_and_duplicate_id(tiny_weights):
    with pytest.raises(InputError, match="max_tokens must be an integer >= 0, got -3"):
        SamplingParams(max_tokens=-3)
    engine = make_engine(tiny_weights)
    engine.add_request([1, 2], request_id="a")
    with pytest.raises(InputError, match="request id 'a' is already in use"):
        engine.add_request([1, 2], request_id="a")


def test_bad_engine_config():
    with pytest.raises(ConfigError, match="dtype 'fp8' unknown"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ConfigError, match="block_size must be in 1..4096"):
        EngineConfig(block_size=0)


def test_cli_reports_errors(capsys):
    assert main(["generate", "hi", "--model", "/nope.gguf"]) == 2
    assert "model '/nope.gguf' not found" in capsys.readouterr().err
    for bad in ("-1", "0"):
        assert main(["generate", "hi", "--model", "dummy:preset=tiny", "--max-tokens", bad]) == 2
        assert f"--max-tokens must be >= 1 (a generate that produces nothing is a mistake), " \
               f"got {bad}\n" in capsys.readouterr().err
    for flags, msg in ((["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
                       (["--temperature", "-0.5"], "temperature must be >= 0, got -0.5"),
                       (["--top-k", "-2"], "top_k must be >= 0 (0 = off), got -2"),
                       (["--dtype", "fp8"], "dtype 'fp8' unknown"),
                       (["--device", "tpu"], "device 'tpu' unknown")):
        assert main(["generate", "hi", "--model", "dummy:preset=tiny", *flags]) == 2, flags
        assert msg in capsys.readouterr().err, flags


@pytest.mark.parametrize("template,match", [
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}",
     r"chat template failed on these messages \(TemplateError: system first\)"),
    ("{% for m in messages %}{{ m.content }", r"chat template failed on these messages "
                                              r"\(TemplateSyntaxError: "),
])
def test_failing_chat_template_is_an_input_error(template, match):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from yuebing.engine.tokenizer import Tokenizer

    tok = Tokenizer(HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
                    template, None, None, add_bos=False)
    with pytest.raises(InputError, match=match):
        tok.encode_chat([{"role": "user", "content": "a"}])
