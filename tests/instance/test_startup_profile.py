"""The instance's start-up profile: the grid each role times, the cache per signature."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from engine_factories import make_engine, tiny  # noqa: E402

from yuebing.instance import startup_profile as sp  # noqa: E402
from yuebing.protocol.instance import Role  # noqa: E402


@pytest.fixture(autouse=True)
def _own_threads():  # type: ignore[no-untyped-def]
    """Tests here set torch's threads: the next test gets them back."""
    own = torch.get_num_threads()
    yield
    torch.set_num_threads(own)


@pytest.fixture
def small_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "PREFILL_NEW", (16, 64, 200))
    monkeypatch.setattr(sp, "PREFILL_CACHED", (0, 128, 400))
    monkeypatch.setattr(sp, "DECODE_BATCHES", (1, 4, 32))
    monkeypatch.setattr(sp, "DECODE_CONTEXTS", (64, 256))


def test_roles_time_their_grids_within_the_engine_limits(small_grid: None) -> None:
    engine = make_engine(tiny(), num_blocks=256)
    pre = sp.measure(engine, Role.PREFILL, engine.signature())
    # 400 cached + 200 new does not fit the 512-token context; the rest is timed
    assert [(n, c) for n, c, _ in pre.prefill] == [(16, 0), (64, 0), (200, 0), (16, 128),
                                                    (64, 128), (200, 128), (16, 400), (64, 400)]
    assert pre.decode == [] and all(s > 0 for *_, s in pre.prefill)
    dec = sp.measure(engine, Role.DECODE, engine.signature())
    # batch 32 exceeds max_num_seqs (16); batch 1 of 256 tokens is fine
    assert [(b, c) for b, c, _ in dec.decode] == [(1, 64), (1, 256), (4, 64), (4, 256)]
    assert dec.prefill == []
    assert dec.configuration == engine.signature()


def test_cached_per_signature_and_role(small_grid: None, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tiny(), num_blocks=256)
    calls: list[Role] = []
    real = sp.measure

    def counting(e, role, signature, lent=0, fill=0, known=None):  # type: ignore[no-untyped-def]
        calls.append(role)
        return real(e, role, signature, lent, fill, known)

    monkeypatch.setattr(sp, "measure", counting)
    first = sp.startup_profile(engine, Role.PREFILL, tmp_path)
    again = sp.startup_profile(engine, Role.PREFILL, tmp_path)
    assert again == first and calls == [Role.PREFILL]
    sp.startup_profile(engine, Role.DECODE, tmp_path)  # another role: its own grid
    assert calls == [Role.PREFILL, Role.DECODE]
    # another configuration (the attention path differs) is profiled afresh, never served the old one
    other = make_engine(tiny(), num_blocks=256, attention="sdpa")
    assert other.signature()["attention"] != engine.signature()["attention"]
    assert sp.startup_profile(other, Role.PREFILL, tmp_path).configuration == other.signature()
    assert calls == [Role.PREFILL, Role.DECODE, Role.PREFILL]
    # a corrupt cache file is measured again and replaced
    path = tmp_path / f"{sp.cache_key(engine.signature(), Role.PREFILL)}.json"
    path.write_text("{not json")
    assert sp.startup_profile(engine, Role.PREFILL, tmp_path).configuration == \
        engine.signature()
    assert len(calls) == 4


def test_a_lending_prefill_times_its_long_prompts_again_on_the_lent_threads(
        small_grid: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "LENT_NEW", (64, 200, 999))  # 999 is not on the grid: not timed
    torch.set_num_threads(1)
    engine = make_engine(tiny(), num_blocks=256)
    threads: list[tuple[int, int, int]] = []
    real = sp.time_prefill

    def noting(e, new, cached, tokens, fill=0):  # type: ignore[no-untyped-def]
        threads.append((new, cached, torch.get_num_threads()))
        return real(e, new, cached, tokens, fill)

    monkeypatch.setattr(sp, "time_prefill", noting)
    pre = sp.startup_profile(engine, Role.PREFILL, tmp_path, lent_threads=2)
    assert pre.lent_threads == 2
    assert [(n, c) for n, c, _ in pre.prefill_lent] == [(64, 0), (200, 0)]
    assert all(s > 0 for *_, s in pre.prefill_lent)
    assert threads[-2:] == [(64, 0, 2), (200, 0, 2)]  # timed on the lent threads ...
    assert {t for *_, t in threads[:-2]} == {1}  # ... the grid on its own
    assert torch.get_num_threads() == 1  # and its own threads back
    # cached apart from the profile without lending, which times nothing twice
    assert sp.cache_key(engine.signature(), Role.PREFILL, 2) != \
        sp.cache_key(engine.signature(), Role.PREFILL)
    plain = sp.startup_profile(engine, Role.PREFILL, tmp_path)
    assert plain.lent_threads == 0 and plain.prefill_lent == []
    assert sp.startup_profile(engine, Role.PREFILL, tmp_path, lent_threads=2) == pre
    # a decode never prefills, and lending no more threads than its own is no lending
    dec = sp.startup_profile(engine, Role.DECODE, tmp_path, lent_threads=2)
    assert dec.lent_threads == 0 and dec.prefill_lent == []
    own = sp.startup_profile(engine, Role.PREFILL, tmp_path, lent_threads=1)
    assert own == plain


def test_a_grid_cached_without_lending_is_reused_for_the_lent_points(
        small_grid: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turning lending on (or an older cache) times only the lent points, not the grid again."""
    monkeypatch.setattr(sp, "LENT_NEW", (64, 200))
    torch.set_num_threads(1)
    engine = make_engine(tiny(), num_blocks=256)
    plain = sp.startup_profile(engine, Role.PREFILL, tmp_path)
    timed: list[tuple[int, int]] = []
    real = sp.time_prefill

    def noting(e, new, cached, tokens, fill=0):  # type: ignore[no-untyped-def]
        timed.append((new, cached))
        return real(e, new, cached, tokens, fill)

    monkeypatch.setattr(sp, "time_prefill", noting)
    lent = sp.startup_profile(engine, Role.PREFILL, tmp_path, lent_threads=2)
    assert timed == [(64, 0), (200, 0)]  # the lent points only
    assert lent.prefill == plain.prefill and lent.lent_threads == 2
    assert sp.startup_profile(engine, Role.PREFILL, tmp_path, lent_threads=2) == lent  # cached


def test_the_untimed_fills_run_on_the_fill_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached prefix and a decode batch's prompts are prefilled with ``fill_threads``; the
    timed prefill and decode steps with the engine's own threads."""
    from yuebing.engine import profile as prof
    torch.set_num_threads(1)
    engine = make_engine(tiny(), num_blocks=256)
    seen: list[tuple[str, int]] = []
    generate, step = engine.generate, engine.step

    def gen(*a, **k):  # type: ignore[no-untyped-def]
        seen.append(("fill", torch.get_num_threads()))
        return generate(*a, **k)

    def stepping():  # type: ignore[no-untyped-def]
        seen.append(("step", torch.get_num_threads()))
        return step()

    monkeypatch.setattr(engine, "generate", gen)
    monkeypatch.setattr(engine, "step", stepping)
    tokens = prof._Tokens(engine.model_config.vocab_size)
    prof.time_prefill(engine, 32, 64, tokens, fill_threads=2)
    fill = 1 + seen.count(("step", 2))  # the fill's own steps, then the timed prefill's
    assert seen[0] == ("fill", 2) and set(seen[1:fill]) == {("step", 2)}
    assert set(seen[fill:]) == {("step", 1)}
    seen.clear()
    prof.time_decode(engine, 2, 64, tokens, steps=4, fill_threads=2)
    assert seen[-4:] == [("step", 1)] * 4 and ("step", 2) in seen[:-4]
    assert torch.get_num_threads() == 1


def test_signature_names_what_changes_step_times() -> None:
    a = make_engine(tiny())
    sig = a.signature()
    for key in ("model", "dtype", "device", "threads", "attention", "prefill_attention",
                "kernels", "batch_invariant", "max_batch_tokens", "machine", "matmul"):
        assert sig[key], key
    assert make_engine(tiny(), max_batch_tokens=32).signature()["max_batch_tokens"] == "32"
    assert make_engine(tiny(), batch_invariant=True, attention="auto").signature()[
        "batch_invariant"] == "true"


def test_unusable_cache_directory_still_profiles(small_grid: None, tmp_path: Path) -> None:
    engine = make_engine(tiny(), num_blocks=256)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    profile = sp.startup_profile(engine, Role.DECODE, blocker / "profiles")
    assert profile.decode and profile.configuration == engine.signature()
