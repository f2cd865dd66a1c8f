"""Build the stand-in CUDA driver, ``tests/fake_cuda/fake_cuda.c``, into ``libcuda.so.1``.

    python -m tests.helpers.fake_cuda build/fake_cuda    # prints the folder it built into
    python -m tests.helpers.fake_cuda --no-hooks build/fake_cuda_plain

``--no-hooks`` builds it without its test hooks (the ``fake_cuda_*`` functions): a process then
sees the driver API only, exactly as it would see a GPU's driver, and the tests that need the
hooks skip as they do on a GPU; the report at exit (violations: status 70) stays.

A process whose ``LD_LIBRARY_PATH`` names that folder when it starts finds the stand-in as its
driver (cuda-python looks the library up by name): CI's CUDA lane runs pytest so, and the
tests of whole programs on the stand-in run their subprocesses so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.process import ROOT, run_python

SOURCE = ROOT / "tests" / "fake_cuda" / "fake_cuda.c"


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` or ``gcc`` on the path; None if none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(folder: Path, hooks: bool = True) -> Path:
    """Compile the stand-in into ``folder/libcuda.so.1`` (made if missing); return ``folder``.
    Without ``hooks`` it exports the driver API only (``-DFAKE_CUDA_NO_HOOKS``).

    Raises ``RuntimeError`` without a C compiler, and ``subprocess.CalledProcessError`` (with
    the compiler's output) when the source does not compile.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler: set CC, or install cc or gcc")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(folder / "libcuda.so.1"), str(SOURCE)]
        + ([] if hooks else ["-DFAKE_CUDA_NO_HOOKS"])
        + ["-lpthread", "-ldl"],
        check=True,
        capture_output=True,
        text=True,
    )
    return folder


def run_on(
    folder: Path | None, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` from the checkout with the stand-in in ``folder`` as the driver
    (any folder without one: no driver at all; None: the environment's own)."""
    if folder is not None:
        env["LD_LIBRARY_PATH"] = str(folder)
    return run_python(*args, timeout=timeout, **env)


if __name__ == "__main__":
    args = sys.argv[1:]
    hooks = "--no-hooks" not in args
    args = [a for a in args if a != "--no-hooks"]
    if len(args) != 1 or args[0].startswith("-"):
        sys.exit("usage: python -m tests.helpers.fake_cuda [--no-hooks] FOLDER")
    try:
        print(build(Path(args[0]).resolve(), hooks=hooks))
    except subprocess.CalledProcessError as exc:
        sys.exit(f"the stand-in driver did not compile:\n{exc.stderr}")
    except RuntimeError as exc:
        sys.exit(f"cannot build the stand-in driver: {exc}")
