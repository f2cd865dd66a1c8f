"""What importing aiostream costs a program, in fresh interpreters, against the imports it
needs anyway (goal: ``import aiostream`` under 60 ms, numpy loaded only when buffers are used).

Each figure is the median over ``--runs`` fresh interpreters of ``python -X importtime``'s
cumulative time for the top-level module (the interpreter's own start-up excluded), from
compiled bytecode, as an installed package is imported (a warm-up run writes it first):

- ``import aiostream``, against ``import anyio`` and ``import asyncio`` (what every asyncio
  program loads anyway) measured the same way in the same run;
- the first use of a stream on ``virtual:0`` and on the default device (the quick start's
  ``ais.Stream()``, which looks for a CUDA driver first: where none is installed it loads
  neither the CUDA backend nor numpy), a ``delay`` awaited, and of a ``HostBuffer`` (which
  loads numpy), as wall time after the import;
- ``import numpy``, for scale.

Usage: python benchmarks/bench_import.py [--runs 15]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import subprocess
import sys

# as an installed package is imported: from its compiled bytecode, which pip writes at install
# (PYTHONDONTWRITEBYTECODE, set on some machines, would have every run compile every module)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

FIRST_STREAM = """
import time, anyio
import aiostream as ais
start = time.perf_counter()
async def main():
    s = ais.Stream(DEVICE)
    ais.delay(0.0, stream=s)
    await s.synchronize()
anyio.run(main)
print("first-use", time.perf_counter() - start, "numpy" in __import__("sys").modules)
"""

FIRST_BUFFER = """
import time
import aiostream as ais
start = time.perf_counter()
ais.HostBuffer(64, device="virtual:0").numpy()
print("first-use", time.perf_counter() - start, "numpy" in __import__("sys").modules)
"""


def driver_library() -> bool:
    """Whether this machine has an NVIDIA driver library (the default device may be CUDA)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def import_ms(module: str) -> float:
    """``-X importtime``'s cumulative microseconds for ``module``, in ms, in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
        env=ENV,
    )
    pattern = rf"^import time:\s+\d+ \|\s+(\d+) \| {re.escape(module)}$"
    found = re.findall(pattern, proc.stderr, re.MULTILINE)
    return int(found[-1]) / 1000


def first_use_ms(code: str) -> tuple[float, bool]:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=ENV
    )
    _, seconds, numpy = proc.stdout.split()
    return float(seconds) * 1000, numpy == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh interpreters per figure")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, not {args.runs}")
    runs = args.runs
    for warm in ("aiostream", "anyio", "asyncio", "numpy"):  # bytecode written once, as at install
        import_ms(warm)
    first_use_ms(FIRST_BUFFER)
    print(f"Python {sys.version.split()[0]}, median of {runs} fresh interpreters\n")
    figures = {m: [import_ms(m) for _ in range(runs)] for m in ("aiostream", "anyio", "asyncio")}
    numpy = statistics.median(import_ms("numpy") for _ in range(runs))
    ours, anyio_ms, asyncio_ms = (statistics.median(figures[m]) for m in figures)
    met = ours < 60
    print("1. import aiostream  (goal: < 60 ms)")
    print(
        f"   {ours:6.1f} ms   (import anyio {anyio_ms:5.1f} ms: ratio {ours / anyio_ms:4.2f};"
        f" import asyncio {asyncio_ms:5.1f} ms: ratio {ours / asyncio_ms:4.2f})"
        f"  {'ok' if met else 'MISS'}"
    )
    print("\n2. first use after the import (wall time)")
    cuda = driver_library()
    for label, code, wants_numpy in (
        (
            "a stream on virtual:0, a delay awaited",
            FIRST_STREAM.replace("DEVICE", "'virtual:0'"),
            False,
        ),
        ("the same on the default device", FIRST_STREAM.replace("DEVICE", ""), cuda),
        ("a HostBuffer's numpy view", FIRST_BUFFER, True),
    ):
        samples = [first_use_ms(code) for _ in range(runs)]
        loaded = {numpy_loaded for _, numpy_loaded in samples}
        ms = statistics.median(ms for ms, _ in samples)
        said = "loads numpy" if loaded == {True} else "no numpy"
        ok = loaded == {wants_numpy}
        print(f"   {label:40} {ms:6.1f} ms   {said}  {'ok' if ok else 'MISS'}")
        met = met and ok
    print(f"\n   (import numpy alone: {numpy:.1f} ms; a driver library here: {cuda})")
    print("\nevery goal met" if met else "\na goal missed")


if __name__ == "__main__":
    main()
