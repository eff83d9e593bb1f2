"""Tests wait on conditions, not clocks: a sleep outside a polling loop says why the time
itself is what it waits for (a TTL, a lease, a fault's length, a fake's delay, "nothing more
happens meanwhile") in a comment on its line or the line above. A wait for some state (a
process ready, a message received, a count reached) polls for that state instead."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _bare_sleeps(path: Path) -> list[int]:
    """Lines of the statement-level ``sleep(x)`` / ``await sleep(x)`` calls (x not 0) that no
    ``while`` or ``for`` loop around them repeats, up to the enclosing function."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Expr):
            continue
        call = node.value.value if isinstance(node.value, ast.Await) else node.value
        if not isinstance(call, ast.Call):
            continue
        f = call.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name != "sleep" or (call.args and isinstance(call.args[0], ast.Constant)
                               and call.args[0].value == 0):
            continue
        up: ast.AST = node
        while up in parents and not isinstance(
                up, (ast.While, ast.For, ast.AsyncFor, ast.FunctionDef, ast.AsyncFunctionDef)):
            up = parents[up]
        if not isinstance(up, (ast.While, ast.For, ast.AsyncFor)):
            found.append(node.lineno)
    return found


def _reason(line: str) -> str:
    """The comment of ``line`` when it says something (not a ``type:`` or ``noqa`` pragma)."""
    comment = line.partition("#")[2].strip()
    return "" if comment.startswith(("type:", "noqa")) else comment


def test_every_fixed_sleep_in_the_tests_says_what_time_it_stands_for() -> None:
    unexplained = []
    for path in sorted(TESTS.rglob("*.py")):
        lines = path.read_text().splitlines()
        for n in _bare_sleeps(path):
            here, above = lines[n - 1], lines[n - 2].strip() if n > 1 else ""
            if not _reason(here) and not (above.startswith("#") and _reason(above)):
                unexplained.append(f"{path.relative_to(TESTS)}:{n}: {here.strip()}")
    assert not unexplained, ("a fixed sleep without a reason: wait for the state it stands "
                             "for, or say which time it is:\n" + "\n".join(unexplained))


def test_the_check_finds_a_bare_sleep(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import time\n\ndef f():\n    time.sleep(0.5)\n    while True:\n"
                      "        time.sleep(0.1)\n    time.sleep(0)\n")
    assert _bare_sleeps(sample) == [4]
    assert _reason("time.sleep(1)  # type: ignore[arg-type]") == ""
    assert _reason("time.sleep(1)  # past the TTL") == "past the TTL"
