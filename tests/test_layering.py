"""DESIGN.md §2 as a test: every import inside ``src/yuebing`` follows the "may import" column.

A package may import itself, the ones listed for it, and anything outside yuebing (stdlib and
declared dependencies; `core` may import only the stdlib). A violation fails with the module,
line and import named."""

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
                  "instance.kvkeys", "store.events", "store.messages",
                  "store.cluster_messages", "engine.tokenizer",
                  "engine.weights", "engine.config", "cluster.discovery", "ops"},
    "engine": {"core"},
    "instance": {"core", "protocol", "engine", "store", "transfer", "cluster.discovery", "ops"},
    "store": {"core", "protocol", "transfer", "ops"},
    "ops": {"core"},
    "transfer": {"core", "protocol"},
    "sim": {"core", "conductor.policy", "conductor.view", "trace"},
    "bench": {"core", "trace"},
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
