"""Choosing between the native kernels and the torch ops: the engine's ``kernels`` knob, the
fallback when the kernels cannot be built, greedy identity of both paths, the CLI build."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_factories import make_engine, prompts

from yuebing.cli.main import main
from yuebing.core.errors import ConfigError
from yuebing.engine import kernels, native
from yuebing.engine.attention import choose_attention
from yuebing.engine.config import EngineConfig
from yuebing.engine.sampling import SamplingParams

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler")
FAILED = native.BuildResult(False, None, "no C++ compiler found (install g++ or set CXX)")


def test_config_rejects_unknown_kernels():
    with pytest.raises(ConfigError, match=r"kernels 'fast' unknown; use one of \('auto', "
                                          r"'native', 'torch'\)"):
        EngineConfig(kernels="fast")


def test_torch_kernels_are_the_reference_ops(tiny_weights):
    engine = make_engine(tiny_weights, kernels="torch")
    assert engine.kernels.name == "torch" and isinstance(engine.model.ops, kernels.TorchOps)


def test_paged_attention_needs_the_native_kernels(tiny_weights):
    with pytest.raises(ConfigError, match="decode attention 'paged' does not run with "
                                          "torch.float32 on cpu with kernels=torch"):
        make_engine(tiny_weights, kernels="torch", attention="paged")


def test_native_kernels_are_cpu_only():
    with pytest.raises(ConfigError, match="kernels=native: native kernels run on CPU only, "
                                          "not cuda; use kernels=auto or torch"):
        kernels.resolve_kernels("native", torch.device("cuda"), torch.bfloat16)
    assert kernels.resolve_kernels("auto", torch.device("cuda"), torch.bfloat16).name == "torch"


def test_build_without_a_compiler_reports_why(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert native._build() == FAILED


def test_auto_falls_back_to_torch_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(native, "load", lambda: FAILED)
    with caplog.at_level(logging.WARNING, logger="yuebing.engine.kernels"):
        ops = kernels.resolve_kernels("auto", torch.device("cpu"), torch.float32)
    assert ops.name == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "native kernels unavailable (no C++ compiler found (install g++ or set CXX)); using "
        "the torch ops"]
    with pytest.raises(ConfigError, match=r"kernels=native: no C\+\+ compiler found"):
        kernels.resolve_kernels("native", torch.device("cpu"), torch.float32)


@needs_compiler
def test_choose_attention_only_times_allowed_decode_paths():
    assert native.load().ok
    decode, _, timings = choose_attention(2, 4, 16, torch.float32, torch.device("cpu"),
                                          batch=2, context=64, repeats=1,
                                          decode_names=["grouped"])
    assert decode == "grouped"
    assert sorted(k for k in timings if k.startswith("decode_")) == ["decode_grouped"]
    _, _, timings = choose_attention(2, 4, 16, torch.float32, torch.device("cpu"), batch=2,
                                     context=64, repeats=1)
    assert "decode_paged" in timings


@needs_compiler
@pytest.mark.parametrize("opts", [dict(max_num_seqs=1), dict(max_num_seqs=16),
                                  dict(max_batch_tokens=16, max_num_seqs=8)])
def test_native_and_torch_paths_generate_the_same_tokens(tiny_weights, opts):
    """Greedy outputs of native ops + paged attention equal the torch path's, across batch
    sizes and chunked prefill (float32; 24 tokens each)."""
    batch = prompts(12, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0)
    ref = make_engine(tiny_weights, kernels="torch", prefill_attention="grouped")
    engine = make_engine(tiny_weights, kernels="native", attention="paged",
                         prefill_attention="grouped", **opts)
    assert (engine.attention, engine.kernels.name) == ("paged", "native")
    expect = [o.output_token_ids for o in ref.generate(batch, params)]
    assert [o.output_token_ids for o in engine.generate(batch, params)] == expect
    assert len({len(t) for t in expect}) == 1 and len(expect[0]) == 24


@needs_compiler
def test_cli_builds_the_kernels(capsys):
    assert main(["engine", "build-kernels", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] is True and info["key"] == native.build_key()
    assert info["library"].endswith(f"yuebing_kernels_{info['key']}.so")


@needs_compiler
@pytest.mark.slow
def test_a_broken_source_fails_the_build_with_the_compiler_error(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    shutil.copytree(native.source_dir(), src)
    (src / "layer_ops.cpp").write_text("int broken( {\n")
    monkeypatch.setattr(native, "source_dir", lambda: src)
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path / "cache")
    result = native._build()
    assert not result.ok and result.path is None
    assert "layer_ops.cpp" in result.error and "error:" in result.error


@needs_compiler
@pytest.mark.slow
def test_portable_code_paths_pass_the_parity_tests(tmp_path):
    """The kernels built without AVX-512 (as on CPUs that lack it: scalar/auto-vectorized
    paths) pass the same parity tests, in a fresh process with its own build cache."""
    env = dict(os.environ, YUEBING_KERNELS_CFLAGS="-mno-avx512f", XDG_CACHE_HOME=str(tmp_path))
    tests = Path(__file__).with_name("test_native_kernels.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tests)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
    built = list((tmp_path / "yuebing" / "kernels").glob("*/yuebing_kernels_*.so"))
    assert len(built) == 1
