"""`conductor.pages`: the prompt's chained page keys and an engine's pages as the Conductor
records them (the sub-block part of the prefill estimate)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from yuebing.conductor.cluster import LiveCluster, _engine_pages
from yuebing.conductor.pages import EnginePages, page_keys
from yuebing.protocol.instance import Hello, Role


def test_page_keys_name_whole_prefixes():
    a = page_keys(list(range(100)), 16, seed=7)
    b = page_keys([*range(40), 999, *range(41, 100)], 16, seed=7)
    assert len(a) == 6  # full pages only: the last 4 tokens get no key
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert page_keys(list(range(100)), 16, seed=8)[0] != a[0]  # another model's
    with pytest.raises(ValueError, match="page_tokens"):
        page_keys([1], 0, seed=0)


def test_extra_walks_pages_past_the_held_blocks_until_the_first_missing():
    pages = EnginePages(16, capacity=1000)
    system = list(range(1, 993))  # 62 pages
    pages.note(page_keys(system + [5] * 50, 16, 0))
    turn = page_keys(system + [6] * 50, 16, 0)
    assert pages.extra(turn, 0, 2000) == 992
    assert pages.extra(turn, 768, 1008) == 224  # past three held 256-token blocks
    assert pages.extra(turn, 0, 240) == 240  # no further than asked
    assert pages.extra(turn, 992, 2000) == 0
    assert pages.extra(page_keys([9] * 500, 16, 0), 0, 500) == 0


def test_the_least_recently_prefilled_pages_go_first_beyond_capacity():
    pages = EnginePages(16, capacity=8)
    old, new = page_keys(list(range(64)), 16, 0), page_keys(list(range(100, 164)), 16, 0)
    pages.note(old)
    pages.note(new)
    assert len(pages) == 8 and pages.extra(old, 0, 64) == 64 and pages.extra(new, 0, 64) == 64
    pages.note(old)  # refreshed: now the newest
    pages.note(page_keys(list(range(200, 264)), 16, 0))
    assert pages.extra(old, 0, 64) == 64 and pages.extra(new, 0, 64) == 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        EnginePages(0, 10)
    with pytest.raises(ValueError, match="positive"):
        EnginePages(16, 0)


def _hello(**kw: object) -> Hello:
    base: dict[str, object] = dict(
        seq=0, instance_id="p0", role=Role.PREFILL, model="m", fingerprint="f", host="h",
        control_address="tcp://h:1", kv_segment="", block_size=16, store_block_tokens=256,
        num_blocks=100, max_model_len=4096, incarnation="i")
    return Hello(**{**base, **kw})


def test_only_whole_model_instances_that_reuse_pages_get_them() -> None:
    pages = _engine_pages(_hello())
    assert pages is not None and (pages.page_tokens, pages.capacity) == (16, 100)
    assert _engine_pages(_hello(role=Role.COUPLED)) is not None
    for kw in ({"role": Role.DECODE}, {"layers": "0:15"}, {"prefix_caching": False},
               {"num_blocks": 0}, {"block_size": 48}):  # 48 does not divide 256
        assert _engine_pages(_hello(**kw)) is None, kw


def test_the_extra_stays_inside_the_next_block_and_short_of_the_last_token() -> None:
    cluster = SimpleNamespace(store_block_tokens=256)
    pages = EnginePages(16, 1000)
    prompt = list(range(1, 1025))  # 1,024 tokens: 64 pages, four whole blocks
    keys = page_keys(prompt, 16, 0)
    pages.note(keys)

    def extra(blocks: int, n: int) -> int:
        return LiveCluster._page_extra(cluster, pages, lambda size: keys, blocks, n)
    assert extra(0, 1024) == 240  # a whole block held would be in the index
    assert extra(2, 1024) == 240
    assert extra(3, 1024) == 240  # the engine reuses 1,008 of 1,024: never the last token
    assert extra(3, 1000) == 992 - 768  # a 1,000-token prompt reuses whole pages to 992
