"""Synthetic workloads (sharing ratios, determinism) and prompt synthesis."""

from __future__ import annotations

import pytest

from yuebing.core.errors import ConfigError
from yuebing.core.hashing import hash_blocks
from yuebing.trace.model import Request, Trace, blocks_needed
from yuebing.trace.prompts import PromptSynthesizer
from yuebing.trace.stats import trace_stats
from yuebing.trace.synth import DocQAConfig, FixedConfig, generate_docqa, generate_fixed, synthesize


def assert_chained(trace: Trace) -> None:
    """Equal id at position j ⇒ equal ids at every earlier position; ids cover the prompt."""
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in trace.requests:
        assert len(r.hash_ids) == blocks_needed(r.input_length)
        for j, h in enumerate(r.hash_ids):
            assert prefix_of.setdefault(h, r.hash_ids[:j]) == r.hash_ids[:j]


def test_fixed_shared_fraction_gives_exact_cache_ratio() -> None:
    cfg = FixedConfig(requests=200, input_tokens=32768, shared_fraction=0.5, prefix_groups=3,
                      rate_per_s=2.0, seed=5)
    t = generate_fixed(cfg)
    assert_chained(t)
    assert cfg.shared_blocks == 32
    assert {r.input_length for r in t.requests} == {32768}
    groups = {r.hash_ids[0] for r in t.requests}
    assert len(groups) == 3
    st = trace_stats(t)
    # every request after the first of its group re-uses its 32 shared blocks out of 64
    assert st.cache_ratio == (200 - 3) * 32 / (200 * 64)
    assert generate_fixed(cfg) == t
    assert generate_fixed(FixedConfig(requests=200, seed=6)) != generate_fixed(
        FixedConfig(requests=200, seed=5))


def test_fixed_partial_blocks_and_no_sharing() -> None:
    t = generate_fixed(FixedConfig(requests=3, input_tokens=1300, shared_fraction=1.0))
    # 2 full blocks shared, the partial third block is each request's own
    assert [r.hash_ids for r in t.requests] == [(0, 1, 2), (0, 1, 3), (0, 1, 4)]
    assert trace_stats(generate_fixed(FixedConfig(requests=50, shared_fraction=0.0))).cache_ratio == 0


def test_docqa_documents_shared_by_their_questions() -> None:
    cfg = DocQAConfig(documents=4, questions_per_document=5, min_document_tokens=2000,
                      max_document_tokens=5000, question_tokens=100, seed=1)
    t = generate_docqa(cfg)
    assert_chained(t)
    assert len(t) == 20
    firsts = {}
    for r in t.requests:
        firsts.setdefault(r.hash_ids[0], []).append(r)
    assert len(firsts) == 4 and all(len(v) == 5 for v in firsts.values())
    doc_blocks = {h: (rs[0].input_length - 100) // 512 for h, rs in firsts.items()}
    repeated = sum(4 * n for n in doc_blocks.values())  # 4 later questions re-use each document
    total = sum(len(r.hash_ids) for r in t.requests)
    assert trace_stats(t).cache_ratio == repeated / total
    assert generate_docqa(cfg) == t


def test_synth_validation() -> None:
    with pytest.raises(ConfigError, match=r"shared_fraction must be in \[0, 1\], got 1.5"):
        FixedConfig(shared_fraction=1.5)
    with pytest.raises(ConfigError, match="min_document_tokens <= max_document_tokens"):
        DocQAConfig(min_document_tokens=10, max_document_tokens=5)
    with pytest.raises(ConfigError, match="unknown synthetic workload 'zipf'"):
        synthesize("zipf")
    with pytest.raises(ConfigError, match="fixed workload: .*unexpected keyword"):
        synthesize("fixed", documents=3)
    assert len(synthesize("fixed", requests=3)) == 3


def test_prompts_realize_hash_id_sharing() -> None:
    ps = PromptSynthesizer(low=100, high=200)
    a = ps.tokens(Request(0, 1500, 1, (1, 2, 3)))
    b = ps.tokens(Request(0, 1200, 1, (1, 2, 9)))
    c = ps.tokens(Request(0, 1100, 1, (1,)), salt=5)
    assert (len(a), len(b), len(c)) == (1500, 1200, 1100)
    assert min(a + b + c) >= 100 and max(a + b + c) < 200
    assert a[:1024] == b[:1024] and a[1024:1200] != b[1024:1200]
    assert a[:512] == c[:512] and a[512:1024] != c[512:1024]
    assert a[:512] == ps.block(1)
    # partial last block = prefix of the full block of its id
    assert ps.tokens(Request(0, 700, 1, (1, 3)))[512:] == ps.block(3)[:188]
    ka, kb, kc = hash_blocks(a, 512), hash_blocks(b, 512), hash_blocks(c, 512)
    assert ka[:2] == kb[:2] and ka[:1] == kc[:1] and ka[1] != kc[1]


def test_prompts_deterministic_seeded_and_salted() -> None:
    r = Request(0, 1024, 1, (4,))  # second block not covered by hash_ids
    ps = PromptSynthesizer()
    assert ps.tokens(r, salt=1) == PromptSynthesizer().tokens(r, salt=1)
    assert ps.tokens(r, salt=1)[:512] == ps.tokens(r, salt=2)[:512]
    assert ps.tokens(r, salt=1)[512:] != ps.tokens(r, salt=2)[512:]
    assert PromptSynthesizer(seed=1).tokens(r)[:512] != ps.tokens(r)[:512]
    assert ps.tokens(Request(0, 0, 1, ())) == []
    prompts = list(ps.prompts(Trace((r, r))))
    assert prompts[0][:512] == prompts[1][:512] and prompts[0][512:] != prompts[1][512:]
    with pytest.raises(ConfigError, match="need 0 <= low < high"):
        PromptSynthesizer(low=5, high=5)
