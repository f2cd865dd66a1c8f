"""The package's shape, as docs/architecture.md draws it: what ruff, mypy and import-linter
cannot check themselves (they check the rest in README's test command)."""

from __future__ import annotations

import pathlib
import re

import pytest

import aiostream

PACKAGE = pathlib.Path(aiostream.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _named_in_the_map() -> set[str]:
    """The modules docs/architecture.md's table "What each module is for" names, as paths
    relative to the package: a row's first cell names modules (``stream.py``) or a folder
    (``_backends/cuda/``, its ``__init__.py`` included), whose modules the row's second cell
    names by their stems, each followed by what it is for (``watcher`` (...))."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("## What each module is for") :]
    table = table[: table.index("\n## ")]
    named: set[str] = set()
    for row in re.findall(r"^\| (.+) \| (.+) \|$", table, re.MULTILINE):
        first, job = row
        for name in re.findall(r"`([\w/.]+)`", first):
            if name.endswith("/"):
                named.add(name + "__init__.py")
                named.update(f"{name}{stem}.py" for stem in re.findall(r"`(\w+)` \(", job))
            else:
                named.add(name)
    return named


def test_the_map_names_every_module_and_no_missing_one() -> None:
    """The layout is described once, in docs/architecture.md: every module of the package is
    in its table, and every module the table names exists."""
    modules = {str(p.relative_to(PACKAGE)) for p in MODULES}
    named = _named_in_the_map()
    assert modules - named == set(), "modules the map does not name"
    assert named - modules == set(), "the map names modules that do not exist"


USER_OBJECTS = [
    "stream",
    "event",
    "interop",
    "graph",
    "_objects",
    "_regions",
    "data/buffers",
    "data/loader",
    "data/_staging",
    "observe/profiler",
]


@pytest.mark.parametrize("module", USER_OBJECTS)
def test_no_user_object_branches_on_a_kind(module: str) -> None:
    """User objects ask a backend for a capability (``_backends.base.Interop``,
    ``Timeline``), never for its kind; only the face (the CLI, messages) names kinds."""
    source = (PACKAGE / f"{module}.py").read_text()
    for needle in ('== "cuda"', '!= "cuda"', '== "virtual"', '!= "virtual"', "backend.kind"):
        assert needle not in source, f"aiostream/{module}.py branches on a kind: {needle}"
