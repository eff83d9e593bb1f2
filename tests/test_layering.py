"""DESIGN.md §2 as a test: every import inside ``src/yuebing`` follows the "may import" column,
and no modules import each other in a circle.

A package may import itself, the ones listed for it, and anything outside yuebing (stdlib and
declared dependencies; `core` may import only the stdlib). A violation fails with the module,
line and import named (imports under ``if TYPE_CHECKING:`` are exempt). A circle counts every
import: module level, inside functions (a lazy import does not hide one) and under ``if
TYPE_CHECKING:`` (a type-only circle is still one a reader must go round); it fails with its
modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "yuebing"

ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "protocol": {"core"},
    "trace": {"core"},
    "conductor.policy": {"core"},
    "conductor": {"core", "conductor.policy", "protocol", "trace", "instance.client",
                  "instance.kvkeys", "store.events", "engine.tokenizer", "engine.weights",
                  "engine.config", "cluster.discovery", "ops"},
    "engine": {"core"},
    "instance": {"core", "protocol", "engine", "store", "transfer", "cluster.discovery", "ops"},
    "store": {"core", "protocol", "transfer", "ops"},
    "ops": {"core"},
    "transfer": {"core", "protocol"},
    "sim": {"core", "conductor.policy", "conductor.view", "trace"},
    "bench": {"core", "trace"},
    "integrations": {"core", "protocol", "store", "transfer", "instance.kvkeys",
                     "instance.profile_cache", "instance.cores", "ops",
                     "cluster.discovery"},
    "cluster": {"*"},
    "cli": {"*"},
}
"""Package → what it may import (dotted under yuebing; a module or a whole package)."""

LEAVES = {"cluster.discovery": {"core"}}
"""Modules inside a package that others may import, held to a stricter rule of their own."""


def _package(module: str) -> str:
    for leaf in LEAVES:
        if module == leaf or module.startswith(leaf + "."):
            return leaf
    for pkg in sorted(ALLOWED, key=len, reverse=True):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return module.split(".")[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) per import; ``from a.b import c`` counts as ``a.b.c`` (a module or a
    name in ``a.b``: either way it is reached through ``a.b.c``'s rule first)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        if module in ("__init__", "__main__"):
            continue
        pkg = _package(module)
        allowed = LEAVES.get(pkg) or ALLOWED.get(pkg, set())
        for line, name in _imports(path):
            if name.split(".")[0] != "yuebing":
                if pkg == "core" and name.split(".")[0] not in sys.stdlib_module_names:
                    bad.append(f"{path.relative_to(SRC.parent)}:{line}: core imports {name} "
                               "(core is stdlib only)")
                continue
            target = name.removeprefix("yuebing.").removeprefix("yuebing")
            if not target or "*" in allowed or _package(target) == pkg:
                continue
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(SRC.parent)}:{line}: {pkg} imports {name} "
                           f"(allowed: {', '.join(sorted(allowed)) or 'nothing in yuebing'})")
    return bad


KNOWN_CIRCLES: dict[str, frozenset[str]] = {}
"""Circles still allowed, by package, each with why and who removes it. Empty: no package has
one. An entry whose circle is gone fails the test, so this list only shrinks."""


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST, typing: bool = False) -> list[str]:
    """Every ``yuebing`` import that runs (module level or in a function), and with
    ``typing`` those under ``if TYPE_CHECKING:`` too."""
    out: list[str] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not typing:
                todo.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                out += [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out += [f"{child.module}.{a.name}" for a in child.names]
            todo.append(child)
    return [n for n in out if n.startswith("yuebing.")]


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (type-only imports included). ``from a import b`` is an edge to ``a.b`` when that is
    a module (a ``.pyi`` stub names a native one), else to ``a``; an edge to a package a
    module lives in is left out (Python imports it first anyway)."""
    files = {".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted(SRC.rglob("*.py*")) if p.suffix in (".py", ".pyi")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        if path.suffix == ".pyi":
            graph.setdefault(mod, set())
            continue
        deps = graph.setdefault(mod, set())
        for name in _runtime_imports(ast.parse(path.read_text(), str(path)), typing=True):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):
                deps.add(name)
    return graph


def _circles() -> dict[str, frozenset[str]]:
    """Each set of modules that import each other in a circle (a strongly connected component
    of `_graph`, Tarjan's), keyed by their package (DESIGN.md §2's, without ``yuebing.``)."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: dict[str, frozenset[str]] = {}

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                pkg = _package(min(comp).removeprefix("yuebing."))
                out[pkg if pkg not in out else min(comp)] = frozenset(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_package_imports_itself_in_a_circle():
    found = _circles()
    new = {k: sorted(c) for k, c in found.items() if KNOWN_CIRCLES.get(k) != c}
    assert not new, f"modules importing each other in a circle: {new}"
    gone = sorted(set(KNOWN_CIRCLES) - set(found))
    assert not gone, f"circles gone: remove them from KNOWN_CIRCLES: {gone}"


def test_the_check_names_a_circle_closed_by_lazy_and_type_only_imports(tmp_path, monkeypatch):
    fake = tmp_path / "yuebing"
    (fake / "store").mkdir(parents=True)
    (fake / "store" / "a.py").write_text("from yuebing.store.b import f\n")
    (fake / "store" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from yuebing.store.c import C\n"
        "def f():\n    from yuebing.store import a\n")
    (fake / "store" / "c.py").write_text("from yuebing.store import b\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert _circles() == {"store": frozenset({"yuebing.store.a", "yuebing.store.b",
                                              "yuebing.store.c"})}


def test_imports_follow_the_design_layers():
    bad = _violations()
    assert not bad, "imports against DESIGN.md §2:\n" + "\n".join(bad)


def test_the_check_names_an_offending_import(tmp_path, monkeypatch):
    fake = tmp_path / "yuebing"
    (fake / "engine").mkdir(parents=True)
    (fake / "engine" / "x.py").write_text("from yuebing.store.client import StoreClient\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert _violations() == ["yuebing/engine/x.py:1: engine imports yuebing.store.client.StoreClient "
                             "(allowed: core)"]


def test_the_cli_store_and_conductor_import_no_torch():
    """`yuebing store master` / `store node` / the Conductor never load torch (~1 s and
    ~300 MB per process on every host): the CLI's parser and every module of `store` and
    `conductor` import without it (the engine's own modules import it where weights are built)."""
    import subprocess

    code = ("import importlib, pkgutil, sys\n"
            "import yuebing.cli.main as m, yuebing.conductor as c, yuebing.store as s\n"
            "m.build_parser()\n"
            "assert 'torch' not in sys.modules, 'the CLI parser'\n"
            "for pkg in (c, s):\n"
            "    for i in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(i.name)\n"
            "        assert 'torch' not in sys.modules, i.name\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
