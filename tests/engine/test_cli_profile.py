"""`yuebing profile` and `yuebing bench engine` end to end on a tiny dummy model."""

from __future__ import annotations

import json

import pytest

from yuebing.cli.main import main
from yuebing.conductor.policy.predictors import load_predictors
from yuebing.engine.profile import ProfileSamples

TINY = "dummy:preset=tiny,layers=2,vocab=256"
COMMON = ["--model", TINY, "--dtype", "float32", "--threads", "1", "--block-size", "16",
          "--num-blocks", "64", "--attention", "grouped", "--no-batch-invariant"]


def test_profile_writes_predictor_and_samples(tmp_path, capsys):
    out, samples = tmp_path / "pred.json", tmp_path / "samples.json"
    rc = main(["profile", "--out", str(out), "--samples", str(samples),
               "--new-tokens", "8,32,64", "--cached-tokens", "0,16,32", "--batches", "1,2",
               "--contexts", "32,64", "--repeats", "1", *COMMON])
    assert rc == 0, capsys.readouterr().err
    s = ProfileSamples.from_json(samples.read_bytes(), str(samples))
    assert sorted((p.new_tokens, p.cached_tokens) for p in s.prefill) == [
        (n, c) for n in (8, 32, 64) for c in (0, 16, 32)]
    assert sorted((d.batch, d.context_tokens) for d in s.decode) == [
        (1, 32), (1, 64), (2, 32), (2, 64)]
    assert all(p.seconds > 0 for p in s.prefill) and s.dtype == "float32"
    pred = load_predictors(out)
    assert pred.prefill.predict(64, 0) > 0 and pred.decode.predict(2, 64) > 0
    assert "yuebing profile" in pred.source
    assert "decode fit vs its samples: mean |error|" in capsys.readouterr().out


def test_profile_long_prompt_adds_each_chunk_on_top_of_the_ones_before(tmp_path, capsys):
    """``--long-prompt``: the chunks of one long prompt as the engine prefills it (chunks of
    ``--max-batch-tokens``), so a long or CPP prefill is fitted on what it runs, not only on
    prefix-cached points of the grid."""
    samples = tmp_path / "samples.json"
    rc = main(["profile", "--out", str(tmp_path / "pred.json"), "--samples", str(samples),
               "--new-tokens", "8,32", "--cached-tokens", "0,16", "--batches", "1,2",
               "--contexts", "32,64", "--repeats", "2", "--long-prompt", "100",
               "--max-batch-tokens", "32", "--max-num-seqs", "2", *COMMON])
    assert rc == 0, capsys.readouterr().err
    s = ProfileSamples.from_json(samples.read_bytes(), str(samples))
    assert [(p.new_tokens, p.cached_tokens) for p in s.prefill][-4:] == [
        (32, 0), (32, 32), (32, 64), (4, 96)]
    assert main(["profile", "--long-prompt", "-1", *COMMON]) == 2
    assert "--long-prompt must be >= 0" in capsys.readouterr().err


def test_profile_decode_degree_sets_the_decode_polynomial(tmp_path, capsys):
    out = tmp_path / "pred.json"
    rc = main(["profile", "--out", str(out), "--new-tokens", "8,32,64", "--cached-tokens", "0,16,32",
               "--batches", "1,2,3", "--contexts", "32,64,96", "--repeats", "1",
               "--decode-degree", "2", *COMMON])
    assert rc == 0, capsys.readouterr().err
    assert len(load_predictors(out).decode.poly.exponents) == 6  # 1, b, c, b², bc, c²


def test_profile_refuses_a_decode_degree_its_grid_cannot_fit_before_measuring(tmp_path, capsys):
    rc = main(["profile", "--out", str(tmp_path / "p.json"), "--batches", "1,2", "--contexts",
               "32,64,96", "--decode-degree", "2", *COMMON])
    err = capsys.readouterr().err
    assert rc == 2 and "needs at least 3 distinct --batches" in err, err
    assert not (tmp_path / "p.json").exists()


def test_bench_engine_json(capsys):
    rc = main(["bench", "engine", "--json", "--batches", "1,2", "--prompt-len", "16",
               "--prefill-lens", "32", "--variants",
               "float32:grouped,float32:sdpa,float32:paged,float32:invariant", *COMMON])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)
    assert [(v["dtype"], v["attention"]) for v in report["variants"]] == [
        ("float32", "grouped"), ("float32", "sdpa"), ("float32", "paged"),
        ("float32", "invariant:paged")]
    for v in report["variants"]:
        assert set(v["decode_ms"]) == {"1", "2"} and set(v["prefill_tok_s"]) == {"32"}
        assert v["paging"]["2"]["paged_ms"] > 0 and v["transfer"]["export_64_GBps"] > 0


def test_profile_rejects_bad_grid(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--new-tokens", "a,b", *COMMON])
    assert "expected comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["profile", "--new-tokens", "0,16"], "argument --new-tokens: expected integers >= 1, got '0,16'"),
    (["profile", "--cached-tokens", "-16"], "argument --cached-tokens: expected integers >= 0"),
    (["bench", "engine", "--batches", "0"], "argument --batches: expected integers >= 1, got '0'"),
    (["bench", "engine", "--prefill-lens", "0"], "argument --prefill-lens: expected integers >= 1"),
])
def test_grids_reject_zero_and_negative(capsys, argv, msg):
    with pytest.raises(SystemExit) as exc:
        main([*argv, *COMMON])
    assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_bench_rejects_bad_prompt_len_and_variants(capsys):
    assert main(["bench", "engine", "--prompt-len", "0", *COMMON]) == 2
    assert "--prompt-len must be >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "engine", "--variants", "float32", *COMMON]) == 2
    assert "--variants items look like bfloat16:grouped" in capsys.readouterr().err


def test_profile_logs_grid_points_it_skips(tmp_path, caplog):
    out = tmp_path / "pred.json"
    with caplog.at_level("WARNING", logger="yuebing.engine.profile"):
        rc = main(["profile", "--out", str(out), "--new-tokens", "8,32,64,5000",
                   "--cached-tokens", "0,16,32", "--batches", "1,2", "--contexts", "32,64,100000",
                   "--repeats", "1", *COMMON])
    assert rc == 0
    skipped = sorted(r.getMessage() for r in caplog.records)
    assert skipped == [
        "skipping decode batch=1 context=100000: needs batch <= context < batch * 1008",
        "skipping decode batch=2 context=100000: needs batch <= context < batch * 1008",
        "skipping prefill new=5000 cached=0: over the context of 1024 tokens",
        "skipping prefill new=5000 cached=16: over the context of 1024 tokens",
        "skipping prefill new=5000 cached=32: over the context of 1024 tokens"]


def test_profile_interference_writes_factors_the_simulator_reads(tmp_path, capsys):
    from yuebing.sim.colocation import load_interference

    out, samples = tmp_path / "pred.json", tmp_path / "samples.json"
    rc = main(["profile", "--out", str(out), "--samples", str(samples),
               "--new-tokens", "8,32,64", "--cached-tokens", "0,16,32", "--batches", "1,2",
               "--contexts", "32,64", "--repeats", "1", "--interference",
               "--interference-decode", "2:64", "--interference-prefill", "32:16", *COMMON])
    assert rc == 0, capsys.readouterr().err
    s = ProfileSamples.from_json(samples.read_bytes(), str(samples))
    assert s.interference is not None
    assert [(x.phase, x.size) for x in s.interference.samples] == [
        ("decode", [2, 64]), ("prefill", [32, 16])]
    assert all(x.alone_s > 0 and x.shared_s > 0 for x in s.interference.samples)
    factors = load_interference(samples)
    assert factors.decode_factor == pytest.approx(
        s.interference.samples[0].shared_s / s.interference.samples[0].alone_s)
    load_predictors(out)  # the predictor file is unchanged: the live Conductor still reads it


def test_profile_interference_needs_a_samples_file(capsys):
    assert main(["profile", "--interference", "--repeats", "1", *COMMON]) != 0
    assert "--samples" in capsys.readouterr().err


def test_samples_without_interference_still_load():
    doc = {"format": "yuebing-profile-samples", "version": 1, "model": "m", "device": "cpu",
           "dtype": "float32", "threads": 1, "block_size": 16, "prefill": [], "decode": []}
    assert ProfileSamples.from_json(json.dumps(doc)).interference is None
