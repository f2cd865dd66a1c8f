"""The package's shape, as docs/architecture.md draws it: what ruff, mypy and import-linter
cannot check themselves (they check the rest in README's test command)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import aiostream

PACKAGE = pathlib.Path(aiostream.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_CLASS_LINES = 300


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_class_is_over_300_lines(path: pathlib.Path) -> None:
    """A class that big holds several ideas: split it into parts that each hold one."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_CLASS_LINES, f"{node.name} has {lines} lines"


USER_OBJECTS = [
    "stream",
    "event",
    "buffers",
    "interop",
    "profiler",
    "loader",
    "graph",
    "_objects",
]


@pytest.mark.parametrize("module", USER_OBJECTS)
def test_no_user_object_branches_on_a_kind(module: str) -> None:
    """User objects ask a backend for a capability (``_backends.base.Interop``,
    ``Timeline``), never for its kind; only the face (the CLI, messages) names kinds."""
    source = (PACKAGE / f"{module}.py").read_text()
    for needle in ('== "cuda"', '!= "cuda"', '== "virtual"', '!= "virtual"', "backend.kind"):
        assert needle not in source, f"aiostream/{module}.py branches on a kind: {needle}"
