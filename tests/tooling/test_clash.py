"""The unrelated PyPI project ``aiostream`` installed beside this one: said, with the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aiostream.__main__ import info
from tests.helpers.process import ROOT, run_python


def _other_metadata(site: Path) -> None:
    """The other project's metadata, as pip installs it into ``site``."""
    meta = site / "aiostream-0.6.4.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: aiostream\nVersion: 0.6.4\n")


def _mixed_install(site: Path) -> None:
    """What ``pip install aiostream`` then ``pip install aiostream-cuda`` leaves: one
    ``aiostream/`` folder with both projects' files (the other's ``stream/`` package shadows
    ``stream.py``) and the other's metadata beside it."""
    shutil.copytree(ROOT / "aiostream", site / "aiostream")
    (site / "aiostream" / "stream").mkdir()
    (site / "aiostream" / "stream" / "__init__.py").write_text("")
    _other_metadata(site)


def _import_from(site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``import aiostream`` in a fresh interpreter that finds the package in ``site`` only."""
    return subprocess.run(
        [sys.executable, "-c", "import aiostream"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PYTHONPATH": str(site), "PATH": ""},
        timeout=60,
    )


def test_an_import_broken_by_the_other_project_names_it_and_the_fix(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _mixed_install(site)
    proc = _import_from(site, tmp_path)
    assert proc.returncode == 1
    error, fix, then = proc.stderr.strip().splitlines()[-3:]
    assert error.startswith("ImportError: aiostream could not be imported (cannot import name")
    assert f"The distribution aiostream 0.6.4 (in {site})" in error
    assert fix == "    python -m pip uninstall -y aiostream aiostream-cuda"
    assert then.startswith("then reinstall this project from its checkout: python -m pip install .")
    assert "not on PyPI yet" in then


@pytest.mark.parametrize("how", ["python -m aiostream", "the aiostream script"])
def test_the_command_line_says_the_fix_without_a_traceback_when_files_are_mixed(
    tmp_path: Path, how: str
) -> None:
    """This project installed after the other: the package cannot be imported, and its
    command line says why and what to run, as a message and exit status 1 (the import
    happens before any of the command line's code runs)."""
    site = tmp_path / "site"
    _mixed_install(site)
    if how == "python -m aiostream":
        cmd = [sys.executable, "-m", "aiostream", "info"]
    else:  # what pip writes for the [project.scripts] entry
        script = tmp_path / "bin" / "aiostream"
        script.parent.mkdir()
        script.write_text(
            f"#!{sys.executable}\nimport sys\nfrom aiostream.__main__ import main\n"
            "sys.exit(main())\n"
        )
        script.chmod(0o755)
        cmd = [str(script), "info"]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": ""},
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("python -m aiostream: aiostream could not be imported (")
    assert f"The distribution aiostream 0.6.4 (in {site})" in proc.stderr
    assert "    python -m pip uninstall -y aiostream aiostream-cuda\n" in proc.stderr


def test_an_import_error_of_another_cause_is_left_as_it_is(tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(ROOT / "aiostream", site / "aiostream")
    (site / "aiostream" / "stream.py").write_text("raise ImportError('a cause of its own')\n")
    proc = _import_from(site, tmp_path)
    assert proc.stderr.strip().splitlines()[-1] == "ImportError: a cause of its own"


def test_info_warns_of_the_other_project(tmp_path: Path) -> None:
    """``python -m aiostream info`` where the other project's metadata is installed beside this
    one (not yet mixed with it: the import still works)."""
    assert "CONFLICT" not in info()
    site = tmp_path / "site"
    _other_metadata(site)
    proc = run_python("-m", "aiostream", "info", PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.replace("\n  ", " ")  # lines the terminal's width wrapped, joined
    assert f"CONFLICT: The distribution aiostream 0.6.4 (in {site}) is installed here too" in text
    assert "python -m pip uninstall -y aiostream aiostream-cuda" in text


def test_this_project_is_not_taken_for_the_other() -> None:
    """This project's own distribution (aiostream-cuda) is no conflict."""
    assert "CONFLICT" not in info()


def _installed_after(site: Path) -> None:
    """What ``pip install aiostream-cuda`` then ``pip install aiostream`` leaves: this
    project's files, but the other's ``__init__.py`` over this one's, and its metadata."""
    shutil.copytree(ROOT / "aiostream", site / "aiostream")
    (site / "aiostream" / "__init__.py").write_text('__all__ = ["stream", "pipe"]\n')
    _other_metadata(site)


def test_the_command_line_says_when_the_other_project_replaced_the_package(
    tmp_path: Path,
) -> None:
    """The other order: ``import aiostream`` gives the other project (nothing of this one
    runs then), but ``python -m aiostream`` still finds it out and says the fix, with no
    traceback."""
    site = tmp_path / "site"
    _installed_after(site)
    proc = subprocess.run(
        [sys.executable, "-m", "aiostream", "info"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "", "COLUMNS": "500"},
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(
        f"python -m aiostream: 'import aiostream' imports {site / 'aiostream' / '__init__.py'}"
        ", which is not aiostream-cuda's: the other project replaced it. The distribution "
        f"aiostream 0.6.4 (in {site}) is installed here too"
    ), proc.stderr
    assert "    python -m pip uninstall -y aiostream aiostream-cuda\n" in proc.stderr


def test_a_release_of_the_other_project_with_our_names_is_still_found_out(
    tmp_path: Path,
) -> None:
    """The other project's ``__init__.py`` defining a ``Stream`` and a ``device`` of its own
    (0.8.1 has a ``Stream``) is not taken for this project's: only ours names its
    distribution."""
    site = tmp_path / "site"
    _installed_after(site)
    (site / "aiostream" / "__init__.py").write_text("Stream = device = None\n")
    code = "import aiostream, aiostream._distribution as c\nprint(c.shadowed(aiostream))\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": ""},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "which is not aiostream-cuda's: the other project replaced it." in proc.stdout


def test_the_pytest_plugin_says_when_the_other_project_replaced_the_package(
    tmp_path: Path,
) -> None:
    """pytest loads this project's plugin (its entry point): a usage error that names the
    other project and the fix, before any test runs."""
    site = tmp_path / "site"
    _installed_after(site)
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_one.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        timeout=120,
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    assert "aiostream's pytest plugin: 'import aiostream' imports" in proc.stderr
    assert "python -m pip uninstall -y aiostream aiostream-cuda" in proc.stderr
    assert "1 passed" not in proc.stdout


OTHER = "aiostream==0.8.1"  # PyPI's unrelated project, as the issue met it


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's wheel, built from the checkout."""
    out = tmp_path_factory.mktemp("wheel")
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "-q",
        "-w",
        str(out),
        str(ROOT),
    )
    (built,) = out.glob("aiostream_cuda-*.whl")
    return built


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The other project's wheel, from the package index (the test skips without one)."""
    out = tmp_path_factory.mktemp("other")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out), OTHER]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"needs the package index for {OTHER}: {proc.stderr.strip()[-300:]}")
    (found,) = out.glob("aiostream-*.whl")
    return str(found)


def _run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
    return proc


def _venv_with(tmp_path: Path, first: str, then: str) -> Path:
    """A fresh venv with ``first`` installed, then ``then``, as pip does it (this project's
    wheel with its dependencies but the CUDA bindings, which info does not need)."""
    home = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(home))
    py = home / "bin" / "python"
    _run(str(py), "-m", "pip", "install", "-q", "anyio", "sniffio", "numpy")
    for spec in (first, then):
        _run(str(py), "-m", "pip", "install", "-q", "--no-deps", spec)
    return py


@pytest.mark.slow
@pytest.mark.timeout(600)  # a wheel built, two venvs, installs from the index: a minute idle
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the venv layout of Linux")
def test_two_real_installs_in_either_order_say_the_fix(
    wheel: Path, other: str, tmp_path: Path
) -> None:
    """pip install of both distributions into one venv, each order (needs the package
    index): this one after the other, ``import aiostream`` fails naming the other and the
    fix; the other after this one, ``import aiostream`` quietly gives it, and
    ``python -m aiostream info`` says so, with the fix."""
    # the venvs' own packages only: a PYTHONPATH of the test's run would bring the checkout
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"COLUMNS": "500"}
    ours_last = _venv_with(tmp_path / "a", other, str(wheel))
    for cmd in (["-c", "import aiostream"], ["-m", "aiostream", "info"]):
        proc = subprocess.run(
            [str(ours_last), *cmd], capture_output=True, text=True, cwd=tmp_path, env=env
        )
        assert proc.returncode == 1
        assert "The distribution aiostream 0.8.1 (in " in proc.stderr, proc.stderr
        assert "python -m pip uninstall -y aiostream aiostream-cuda" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # the command line's: a message

    theirs_last = _venv_with(tmp_path / "b", str(wheel), other)
    check = "import aiostream; print(aiostream.__version__)"
    quiet = subprocess.run(
        [str(theirs_last), "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env
    )  # not the checkout's folder
    assert quiet.stdout.strip() == "0.8.1", quiet.stderr  # the other: nothing of ours runs
    proc = subprocess.run(
        [str(theirs_last), "-m", "aiostream", "info"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "which is not aiostream-cuda's: the other project replaced it" in proc.stderr
    assert "The distribution aiostream 0.8.1 (in " in proc.stderr
