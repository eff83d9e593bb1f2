"""Only `yuebing.core.env` reads the environment: a variable read anywhere else is a knob no one
can find. Handing the whole environment to a child (``{**os.environ, ...}``) is not a read."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "yuebing"


def _reads(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):  # os.getenv(...), os.environ.get(...)
            f = node.func
            if isinstance(f, ast.Attribute) and (
                    f.attr == "getenv" or (f.attr == "get" and _is_environ(f.value))):
                found.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) \
                and isinstance(node.ctx, ast.Load):  # os.environ["X"]
            found.append(node.lineno)
    return found


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def test_only_core_env_reads_environment_variables() -> None:
    reads = [f"{p.relative_to(SRC)}:{n}" for p in sorted(SRC.rglob("*.py"))
             if p != SRC / "core" / "env.py" for n in _reads(p)]
    assert not reads, f"read the environment through yuebing.core.env: {reads}"


def test_the_check_finds_each_form(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import os\na = os.getenv('A')\nb = os.environ.get('B')\n"
                      "c = os.environ['C']\nd = {**os.environ, 'X': '1'}\n")
    assert _reads(sample) == [2, 3, 4]
