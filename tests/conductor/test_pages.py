"""`conductor.pages`: the prompt's chained page keys and an engine's pages as the Conductor
records them (the sub-block part of the prefill estimate)."""

from __future__ import annotations

import pytest

from yuebing.conductor.pages import EnginePages, page_keys


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
    assert pages.extra(turn, 0) == 992
    assert pages.extra(turn, 768) == 224  # past three held 256-token blocks
    assert pages.extra(turn, 992) == 0
    assert pages.extra(page_keys([9] * 500, 16, 0), 0) == 0


def test_the_least_recently_prefilled_pages_go_first_beyond_capacity():
    pages = EnginePages(16, capacity=8)
    old, new = page_keys(list(range(64)), 16, 0), page_keys(list(range(100, 164)), 16, 0)
    pages.note(old)
    pages.note(new)
    assert len(pages) == 8 and pages.extra(old, 0) == 64 and pages.extra(new, 0) == 64
    pages.note(old)  # refreshed: now the newest
    pages.note(page_keys(list(range(200, 264)), 16, 0))
    assert pages.extra(old, 0) == 64 and pages.extra(new, 0) == 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        EnginePages(0, 10)
    with pytest.raises(ValueError, match="positive"):
        EnginePages(16, 0)
