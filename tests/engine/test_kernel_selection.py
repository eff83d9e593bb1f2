"""Choosing between the native kernels and the torch ops: the engine's ``kernels`` knob, the
fallback when the kernels cannot be built, greedy identity of both paths, the CLI build."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
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
def test_an_unwritable_cache_falls_back_to_torch_with_one_warning(tmp_path, monkeypatch,
                                                                  caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(native, "_result", None)
    with caplog.at_level(logging.WARNING, logger="yuebing.engine.kernels"):
        ops = kernels.resolve_kernels("auto", torch.device("cpu"), torch.bfloat16)
    assert isinstance(ops, kernels.TorchOps)
    root = blocker / "yuebing" / "kernels"
    assert [r.getMessage() for r in caplog.records] == [
        f"native kernels unavailable (cannot use the kernel cache {root}: [Errno 20] Not a "
        f"directory: '{root}'; set XDG_CACHE_HOME to a writable directory); using the torch ops"]
    assert blocker.read_text() == ""


def test_the_build_key_covers_checkout_venv_and_compiler(tmp_path, monkeypatch):
    """Each input torch writes into build.ninja changes the key (a different checkout, venv,
    $CXX or compiler version never shares a build); the same inputs give the same key."""
    base = native.build_key()
    assert native.build_key() == base
    src = tmp_path / "csrc"
    shutil.copytree(native.source_dir(), src)
    keys = {base}
    for change in (lambda m: m.setattr(native, "source_dir", lambda: src),
                   lambda m: m.setattr(sys, "prefix", "/elsewhere/venv"),
                   lambda m: m.setenv("CXX", "c++"),
                   lambda m: m.setattr(native, "_compiler_version", lambda c: "clang 99.0")):
        with monkeypatch.context() as m:
            change(m)
            keys.add(native.build_key())
    assert len(keys) == 5 and native.build_key() == base


def test_the_build_lock_waits_for_its_holder_and_is_released_when_it_dies(tmp_path):
    """A builder killed mid-build must not block later builds: the flock dies with it."""
    lock = tmp_path / "k.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
         "os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
         "time.sleep(600)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        entered = threading.Event()

        def take() -> None:
            with native._exclusive(lock):
                entered.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        assert not entered.wait(0.5)  # the holder is alive: wait
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert entered.wait(10)  # SIGKILL released it, though the file stays
    waiter.join(10)
    assert lock.exists()
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released again on leaving the block
    finally:
        os.close(fd)


def _copy_build(tmp_path: Path) -> Path:
    """The loaded library hard-linked into a fresh cache under ``tmp_path`` (same inode, so
    loading it again in this process is the same library)."""
    built = native.load()
    assert built.ok and built.path is not None
    library = tmp_path / "yuebing" / "kernels" / native.build_key() / built.path.name
    library.parent.mkdir(parents=True)
    os.link(built.path, library)
    return library


@needs_compiler
def test_stale_lock_files_do_not_block_loading(tmp_path):
    """A killed builder's lock files (torch's baton ``lock``, ``<key>.lock``) are left behind;
    a fresh process still loads the finished library at once (no compiler, no baton)."""
    library = _copy_build(tmp_path)
    (library.parent / "lock").touch()
    library.parent.with_name(f"{library.parent.name}.lock").touch()
    proc = subprocess.run(
        [sys.executable, "-c", "from yuebing.engine import native; r = native.load(); "
         "print(r.ok, r.path, r.error)"], env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path)),
        capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["True", str(library)], proc.stderr[-2000:]


@needs_compiler
def test_a_library_built_while_waiting_for_the_lock_is_loaded_not_rebuilt(tmp_path,
                                                                          monkeypatch):
    built = native.load()
    key = native.build_key()
    library = tmp_path / "yuebing" / "kernels" / key / f"yuebing_kernels_{key}.so"

    @contextmanager
    def another_process_finishes(path):
        assert path == library.parent.with_name(f"{key}.lock")
        library.parent.mkdir()
        os.link(built.path, library)
        yield

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_exclusive", another_process_finishes)
    monkeypatch.setattr(native, "_compile", lambda *a: pytest.fail("rebuilt a finished build"))
    assert native._build() == native.BuildResult(True, library)


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
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512bf16"])
def test_portable_code_paths_pass_the_parity_tests(tmp_path, flags):
    """The kernels built without AVX-512 (as on CPUs that lack it: scalar/auto-vectorized
    paths) or with AVX-512F but without AVX512-BF16 (Skylake-SP, Ice Lake: bf16 decode
    without ``vdpbf16ps``, flash's portable softmax and P·V) pass the same decode and flash
    parity tests, in a fresh process with its own build cache."""
    env = dict(os.environ, YUEBING_KERNELS_CFLAGS=flags, XDG_CACHE_HOME=str(tmp_path))
    tests = [str(Path(__file__).with_name(f)) for f in ("test_native_kernels.py",
                                                        "test_flash_prefill.py")]
    # the AMX kernel is not built here (it needs AVX512-BF16): its tests would skip; the
    # refusal of its operator (test_flash_rejects_bad_inputs[flash_prefill_attention_amx-…]) runs
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-k", "not flash_amx and not test_amx_agrees", *tests], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
    built = list((tmp_path / "yuebing" / "kernels").glob("*/yuebing_kernels_*.so"))
    assert len(built) == 1


@needs_compiler
@pytest.mark.slow
def test_two_processes_building_one_fresh_cache_both_load_one_library(tmp_path):
    """Concurrent first builds: one compiles under the key's flock, the other waits and loads
    the finished library; no temporary directory is left behind."""
    code = "from yuebing.engine import native; r = native.load(); print(r.ok, r.path, r.error)"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    root = tmp_path / "yuebing" / "kernels"
    built = sorted(root.glob("*/yuebing_kernels_*.so"))
    assert len(built) == 1
    assert [o.split() for o, _ in outs] == [["True", str(built[0])]] * 2, outs
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [built[0].parent.name, f"{built[0].parent.name}.lock"])


def test_prune_removes_only_other_long_unused_builds(tmp_path):
    old = time.time() - native.PRUNE_AFTER_S - 60
    for name in ("aaaa", "aaaa.lock", "bbbb", "bbbb.lock", "cccc", "dddd.tmp-12"):
        entry = tmp_path / name
        if name.endswith(".lock"):
            entry.write_text("")
        else:
            entry.mkdir()
            (entry / "x.so").write_text("")
        os.utime(entry, (old, old))
    os.utime(tmp_path / "cccc")  # used just now
    removed = native.prune(tmp_path, "aaaa")
    assert sorted(p.name for p in removed) == ["bbbb", "bbbb.lock", "dddd.tmp-12"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aaaa", "aaaa.lock", "cccc"]
