"""The sync and asyncio store clients stay thin drivers over one core (`store/client/core.py`,
`gets.py`, `puts.py`): no run of `RUN` or more lines repeats between `StoreClient` and `AsyncStoreClient`,
also once ``async``/``await`` are stripped — logic they share belongs in the core, once."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import yuebing.store.client.client as client_module
from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.config import ClientConfig

RUN = 6
SKIP = re.compile(r"^(#.*|[()\[\]{}:,]*|\"\"\"|@.*)$")
"""Lines that say nothing of their own (as the workplace `duplicates` tool passes them over):
comments, lone punctuation, bare docstring quotes, decorators."""


def _lines(source: str, cls: ast.ClassDef) -> list[tuple[int, str]]:
    """The class's code lines, numbered: whitespace folded, ``async ``/``await `` stripped,
    blank and content-free lines dropped."""
    out = []
    for no, line in enumerate(source.splitlines()[cls.lineno - 1:cls.end_lineno], cls.lineno):
        text = re.sub(r"\b(async|await)\s+", "", " ".join(line.split()))
        if text and not SKIP.match(text):
            out.append((no, text))
    return out


def repeated_runs(source: str, a: str, b: str, run: int = RUN) -> list[tuple[int, int]]:
    """(line in class ``a``, line in class ``b``) where ``run`` consecutive code lines of the
    two classes of ``source`` are the same."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    la, lb = _lines(source, classes[a]), _lines(source, classes[b])
    seen: dict[tuple[str, ...], int] = {}
    for i in range(len(la) - run + 1):
        seen.setdefault(tuple(t for _, t in la[i:i + run]), la[i][0])
    return [(seen[w], lb[j][0]) for j in range(len(lb) - run + 1)
            if (w := tuple(t for _, t in lb[j:j + run])) in seen]


def test_the_check_finds_a_run_that_differs_only_by_await() -> None:
    twin = "\n".join(f"        x{i} = f({i})" for i in range(RUN))
    source = (f"class A:\n    def f(self):\n{twin}\n\n"
              f"class B:\n    async def f(self):\n{twin.replace('= f(', '= await f(')}\n")
    assert repeated_runs(source, "A", "B") == [(2, 11), (3, 12)]
    assert repeated_runs(source.replace("x3 = await", "y3 = await"), "A", "B") == []


def test_the_sync_and_async_clients_share_no_run_of_six_lines() -> None:
    source = Path(client_module.__file__).read_text()
    found = repeated_runs(source, "StoreClient", "AsyncStoreClient")
    assert found == [], (f"StoreClient and AsyncStoreClient repeat {RUN}+ lines at (sync line, "
                         f"async line) {found}: move the shared logic into store/client/core.py, "
                         "gets.py or puts.py")


API = ["put", "put_from", "batch_put", "batch_put_from", "get", "get_into", "batch_get",
       "batch_get_into", "exists", "batch_exists", "prefix_match", "remove", "batch_remove",
       "remove_prefix", "remove_all", "pin", "stats", "close"]


def test_both_clients_have_one_api_with_typed_keywords() -> None:
    """The same parameters (names, kinds, defaults, annotations) in both clients, and no
    catch-all ``**kw`` a misspelt keyword could slip through."""
    for name in API:
        sync = inspect.signature(getattr(StoreClient, name)).parameters
        aio = inspect.signature(getattr(AsyncStoreClient, name)).parameters
        assert list(sync.values()) == list(aio.values()), name
        assert all(p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in sync.values()), name
        assert all(p.annotation is not p.empty for n, p in sync.items() if n != "self"), name


def test_a_misspelt_batch_put_keyword_is_refused_before_anything_is_sent() -> None:
    c = StoreClient(ClientConfig(master="127.0.0.1:1"), heartbeat=False)
    try:
        with pytest.raises(TypeError, match="replica"):
            c.batch_put(["k"], [b"v"], replica=2)  # type: ignore[call-arg]
    finally:
        c.close()
