"""The module layout the design relies on: the planner and the executor share
what they need from modules below both, so neither imports the other's callers."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "seqckpt"


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_planner_does_not_import_the_sequential_front_end() -> None:
    for path in sorted((PACKAGE / "planner").glob("*.py")):
        assert "seqckpt.sequential" not in imported_modules(path), path.name


def test_the_executor_and_the_primitive_do_not_import_the_front_end() -> None:
    primitive = ("checkpoint.py", "_region.py", "_options.py", "_fingerprint.py")
    for name in ("executor.py", *primitive, "_buffers.py", "_chain.py"):
        assert "seqckpt.sequential" not in imported_modules(PACKAGE / name), name
