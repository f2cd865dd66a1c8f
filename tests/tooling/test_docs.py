"""README's and docs/'s code blocks run, and print what they say they print; the docs refer to
nothing outside the repository.

Each Python block is a whole program (or a whole test file). What a block prints is written
under the print as ``#> output`` and checked by pytest-examples; ``pytest tests/tooling/test_docs.py
--update-examples`` rewrites those lines after a deliberate change. Blocks that need a GPU (or
PyTorch) skip, saying so, where there is none.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pytest_examples import CodeExample, EvalExample, find_examples

import aiostream as ais
from tests.helpers.process import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = list(find_examples(*DOCS))


def _id(example: CodeExample) -> str:
    return f"{example.path.relative_to(ROOT)}:{example.start_line}"


def _is_test_file(source: str) -> bool:
    return "\ndef test_" in source or "\nasync def test_" in source


def _param(example: CodeExample) -> object:
    # a block that is a test file runs pytest in a child process: the full lane's
    marks = [pytest.mark.slow] if _is_test_file(example.source) else []
    return pytest.param(example, id=_id(example), marks=marks)


def _missing(source: str) -> str | None:
    """Why a block cannot run here, or None."""
    if "torch" in source and importlib.util.find_spec("torch") is None:
        return "needs PyTorch and a GPU"
    if '"cuda:' in source and not ais.is_available("cuda"):
        return "needs a CUDA GPU"
    return None


def test_every_python_block_is_found() -> None:
    # a block the finder misses would never run: count them against the fences
    fences = sum(path.read_text().count("```python\n") for path in DOCS)
    assert len(EXAMPLES) == fences > 0


@pytest.mark.parametrize("example", [_param(e) for e in EXAMPLES])
def test_code_block_runs(
    example: CodeExample,
    eval_example: EvalExample,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # what a block writes lands here
    why = _missing(example.source)
    if why is not None:
        compile(example.source, _id(example), "exec")  # valid Python, at least
        pytest.skip(why)
    if _is_test_file(example.source):
        test = tmp_path / "test_block.py"
        test.write_text(example.source)
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert " passed" in proc.stdout and "skipped" not in proc.stdout
        return
    main = {"__name__": "__main__"}  # blocks guarded by `if __name__ == "__main__":` run too
    if eval_example.update_examples:
        eval_example.run_print_update(example, module_globals=main)
    else:
        eval_example.run_print_check(example, module_globals=main)


def test_docs_refer_to_nothing_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.split()
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".md", ".py", ".toml", ".sh", ".c", ".cu", ".txt", ""):
            continue
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for outside in ("DESIGN" + ".md", "../" + "shared"):  # spelt so: this file is read too
            assert outside not in text.replace("docs/design.md", ""), f"{name} names {outside}"


def test_nothing_tells_a_user_to_install_from_an_index_that_lacks_the_project() -> None:
    """The distribution is not on PyPI yet: no doc, example or message of the package tells
    a user to ``pip install aiostream-cuda`` as if it were, and README says how to install."""
    paths = [*DOCS, *(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    paths += (ROOT / "aiostream").rglob("*.py")
    for path in paths:
        text = path.read_text()
        for line in text.splitlines():
            # any spelling pip takes (aiostream_cuda, Aiostream.CUDA), with options between
            if re.search(r"pip3? install (-\S+ )*[\"']?aiostream[-_.]cuda\b", line, re.I):
                assert "not on PyPI" in line or "finds nothing" in line, f"{path}: {line}"
    readme = (ROOT / "README.md").read_text()
    assert "python -m pip install ." in readme and "is not on\nPyPI yet" in readme
