"""The test suite's own shape: folders that mirror the package, files of readable size, helpers
in a package, and behaviour tested through public names outside ``tests/internals/``.

ruff's SLF001 (in README's test command) refuses a private attribute of the package outside
``tests/internals/``; this file checks what ruff cannot: the layout, the size of each file, and
which of the package's modules a test imports.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.helpers.process import ROOT

TESTS = ROOT / "tests"
#: the folders of tests/, each a package: one per area of aiostream, the white-box tests, the
#: shared helpers, and the stand-in driver's C source
FOLDERS = {
    "api",
    "waiting",
    "virtual",
    "cuda",
    "data",
    "profiler",
    "testing",
    "interop",
    "completions",
    "tooling",
    "internals",
    "helpers",
    "fake_cuda",
}
MAX_LINES = 800
#: where the package's insides may be imported: the white-box tests, and the helpers that are
#: the suite's one seam onto the backend protocol and the stand-in driver
INSIDE = ("internals", "helpers")
#: the package's public modules (README's API tables); the CLI's entry module is public too
PUBLIC = {"aiostream", "aiostream.virtual", "aiostream.testing", "aiostream.testing.plugin"}
PUBLIC |= {"aiostream.tracing", "aiostream.metrics"}
PUBLIC |= {"aiostream.__main__"}

SOURCES = sorted(TESTS.rglob("*.py"))


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(TESTS))


def test_tests_live_in_the_folders_of_the_areas() -> None:
    top = {p.name for p in TESTS.iterdir() if not p.name.startswith((".", "__pycache__"))}
    assert top - {"__init__.py", "conftest.py"} == FOLDERS, "tests/ holds folders only"
    for folder in FOLDERS - {"fake_cuda"}:
        for sub in [TESTS / folder, *(TESTS / folder).rglob("*/")]:
            if sub.is_dir() and sub.name != "__pycache__":
                assert (sub / "__init__.py").exists(), f"{_rel(sub)} is not a package"


@pytest.mark.parametrize("path", SOURCES + sorted(TESTS.rglob("*.c")), ids=_rel)
def test_no_test_file_is_over_800_lines(path: pathlib.Path) -> None:
    """Past that, a file holds several subjects: split it, each part named for its own."""
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_rel(path)} has {lines} lines"


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import of the file, ``from X import Y`` as ``X.Y``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, "." * node.level + (node.module or ""))]
    return found


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_helpers_come_from_the_helpers_package_never_a_conftest(path: pathlib.Path) -> None:
    for line, module in _imports(path):
        assert "conftest" not in module, f"{_rel(path)}:{line} imports {module}"
        assert not module.startswith("."), f"{_rel(path)}:{line}: import tests.helpers.<name>"


OUTSIDE = [p for p in SOURCES if _rel(p).split("/")[0] not in INSIDE]


@pytest.mark.parametrize("path", OUTSIDE, ids=_rel)
def test_outside_internals_tests_import_only_public_modules(path: pathlib.Path) -> None:
    """The package's private modules are its insides: a test of them belongs in internals/,
    where a refactoring that keeps every behaviour may break it."""
    for line, module in _imports(path):
        parts = module.split(".")
        if parts[0] != "aiostream":
            continue
        private = [p for p in parts if p.startswith("_") and p != "__main__"]
        assert not private, f"{_rel(path)}:{line} imports {module}: a private module"
        if len(parts) > 2:  # from aiostream.virtual import X: X is a name, not a module
            assert ".".join(parts[:-1]) in PUBLIC, f"{_rel(path)}:{line} imports {module}"
