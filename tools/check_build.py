"""Build the sdist and the wheel as a release would, with warnings as errors, and install the
wheel in a fresh virtual environment.

    python tools/check_build.py [--keep DIR]

CI runs it after the tests (``.ci/run``). It fails when:

- the build prints a warning (setuptools announces its deprecations as warnings, with the date
  after which such a project stops building; one seen here is one fixed now);
- the wheel lacks what the package needs at run time (the PTX kernel, ``py.typed``) or the
  sdist lacks the license;
- the wheel, installed alone in a fresh venv (its dependencies from the index), cannot be
  imported, run its CLI (``aiostream --version``, ``python -m aiostream info``) or wait on a
  virtual device.

Needs the ``build`` package (in the ``[test]`` extra) and the package index.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# what the wheel must hold besides the Python modules
WHEEL_NEEDS = (
    "aiostream/py.typed",
    "aiostream/_backends/cuda/kernels/sleep.ptx",
    "aiostream/_backends/cuda/kernels/sleep.cu",
)

SMOKE = """
import anyio, aiostream as ais

async def main():
    s = ais.Stream("virtual:0")
    ais.delay(0.001, stream=s)
    await s
    print("waited on", s.device)

anyio.run(main)
"""


def _run(cmd: list[str], **kwargs: object) -> str:
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    out = done.stdout + done.stderr
    if done.returncode != 0:
        sys.exit(f"{out}\nfailed ({done.returncode}): {' '.join(cmd)}")
    return str(out)


def _warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r"warn", line, re.IGNORECASE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="build into DIR and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "dist"
        env = dict(os.environ)
        # byte-compiling off makes setuptools print a warning of its own about it
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        log = _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], env=env)
        if found := _warnings(log):
            sys.exit("the build warned:\n  " + "\n  ".join(found) + f"\n\n{log}")
        (wheel,) = out.glob("*.whl")
        (sdist,) = out.glob("*.tar.gz")
        names = set(zipfile.ZipFile(wheel).namelist())
        if missing := [n for n in WHEEL_NEEDS if n not in names]:
            sys.exit(f"{wheel.name} lacks {missing}")
        if not any(n.endswith("/LICENSE") for n in tarfile.open(sdist).getnames()):
            sys.exit(f"{sdist.name} lacks LICENSE")
        print(f"built {sdist.name} and {wheel.name} without a warning")

        home = Path(tmp) / "venv"
        venv.create(home, with_pip=True)
        python = str(home / ("Scripts" if os.name == "nt" else "bin") / "python")
        _run([python, "-m", "pip", "install", "-q", str(wheel)])
        clean = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "AIOSTREAM_DEVICE")}
        _run([python, "-m", "aiostream", "--version"], env=clean, cwd=tmp)
        print(_run([python, "-m", "aiostream", "info"], env=clean, cwd=tmp))
        print(_run([python, "-c", SMOKE], env=clean, cwd=tmp))
        print("the wheel installs and runs in a fresh venv")


if __name__ == "__main__":
    main()
