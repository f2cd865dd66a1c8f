"""The public surface: each module exports exactly its documented names, and docs/api.md's
tables list them."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from tests.helpers.process import ROOT

MODULES = ["aiostream", "aiostream.virtual", "aiostream.testing", "aiostream.testing.plugin"]


def readme_tables() -> dict[str, set[str]]:
    section = (ROOT / "docs" / "api.md").read_text()
    tables: dict[str, set[str]] = {}
    for block in re.split(r"^### ", section, flags=re.MULTILINE)[1:]:
        module = re.match(r"`([\w.]+)`", block).group(1)  # type: ignore[union-attr]
        tables[module] = set(re.findall(r"^\| `([\w]+)` \|", block, re.MULTILINE))
    return tables


@pytest.mark.parametrize("name", MODULES)
def test_a_module_exports_exactly_its_documented_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__), "a name is listed twice"
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ names {attr}, which is missing"
    assert exported == readme_tables()[name], f"docs/api.md's table for {name} differs"
    if name != "aiostream.testing.plugin":  # pytest's hooks live there too, by design
        public = {n for n in dir(module) if not (n.startswith("_") and n != "__version__")}
        assert public == exported, f"dir({name}) shows more than its names: {public - exported}"


@pytest.mark.slow
def test_testing_imports_and_runs_without_pytest() -> None:
    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "import aiostream as ais\n"
        "from aiostream.testing import run_in_virtual_time\n"
        "async def ten():\n"
        "    s = ais.Stream('virtual:0'); ais.delay(10.0, stream=s); await s.synchronize()\n"
        "    return ais.virtual.now()\n"
        "print(run_in_virtual_time(ten))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "10.0"
