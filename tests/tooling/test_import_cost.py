"""What ``import aiostream`` loads, and what only the first use of a part does: numpy with
buffers and loaders, the profiler, graphs and the loader with their names, the CUDA bindings
only where a driver library exists. Each runs in a fresh interpreter (what is imported there is
the program's own); how long the import takes is measured in ``benchmarks/bench_import.py``."""

from __future__ import annotations

import ctypes.util
import json
from pathlib import Path

import pytest

from tests.helpers.fake_cuda import run_on
from tests.helpers.process import run_python

LOADED = "import json, sys; print(json.dumps(sorted(m for m in sys.modules)))"

HEAVY = (
    "numpy",
    "aiostream.observe.profiler",
    "aiostream.data.loader",
    "aiostream.data.buffers",
    "aiostream.graph",
)


def loaded_after(code: str, folder: Path | None = None) -> set[str]:
    script = f"{code}\n{LOADED}"
    proc = run_python("-c", script) if folder is None else run_on(folder, "-c", script)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.splitlines()[-1]))


def test_import_aiostream_loads_the_core_only() -> None:
    modules = loaded_after("import aiostream")
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    assert "cuda.bindings" not in modules
    assert "importlib.metadata" not in modules  # the version is read when asked for


@pytest.mark.parametrize(
    ("use", "loads"),
    [
        ("ais.HostBuffer(64, device='virtual:0').numpy()", {"numpy", "aiostream.data.buffers"}),
        ("ais.Profiler", {"aiostream.observe.profiler"}),
        ("ais.Graph('virtual:0')", {"aiostream.graph"}),
        ("ais.DataLoader", {"aiostream.data.loader"}),
        ("ais.virtual.races()", {"aiostream.virtual"}),
    ],
)
def test_each_part_loads_on_its_first_use(use: str, loads: set[str]) -> None:
    modules = loaded_after(f"import aiostream as ais\n{use}")
    assert loads <= modules, sorted(loads - modules)


def test_a_stream_on_a_virtual_device_needs_no_numpy() -> None:
    code = (
        "import anyio, aiostream as ais\n"
        "s = ais.Stream('virtual:0')\n"
        "ais.delay(0.001, stream=s)\n"
        "anyio.run(s.synchronize)\n"
    )
    assert "numpy" not in loaded_after(code)


def test_every_documented_name_is_there_and_others_are_not() -> None:
    code = (
        "import aiostream as ais\n"
        "from aiostream import *\n"
        "missing = [n for n in ais.__all__ if n not in globals()]\n"
        "assert not missing, missing\n"
        "assert isinstance(ais.__version__, str) and ais.__version__\n"
        "try:\n"
        "    ais.Streem\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "module 'aiostream' has no attribute 'Streem'"


def test_without_a_driver_library_the_default_device_loads_no_cuda_and_no_numpy(
    tmp_path: Path,
) -> None:
    """No libcuda.so.1 to load: the default device is virtual:0, found without importing
    cuda-python's bindings, the CUDA backend's modules or numpy (the quick start's first
    stream on the loop does not pay for them), and the reason says what is missing."""
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver library")
    code = (
        "import anyio, aiostream as ais\n"
        "from aiostream import _backends\n"
        "s = ais.Stream()\n"
        "ais.delay(0.001, stream=s)\n"
        "anyio.run(s.synchronize)\n"
        "print(ais.device())\n"
        "print(_backends.probe('cuda')[1])\n"
    )
    modules = loaded_after(code, tmp_path)  # a folder without a driver library on the path
    loaded = modules & {"cuda.bindings", "numpy", "aiostream._backends.cuda.backend"}
    assert not loaded, sorted(loaded)
    proc = run_on(tmp_path, "-c", code)
    first, reason = proc.stdout.splitlines()[:2]
    assert first == "virtual:0"
    assert reason.startswith("no NVIDIA driver library (libcuda.so.1) could be loaded (")
    assert reason.endswith("); install the NVIDIA driver, or use a virtual device ('virtual:0')")


def test_with_a_driver_library_the_bindings_are_used(stand_in_folder: Path) -> None:
    modules = loaded_after("import aiostream as ais\nais.device('cuda:0')", stand_in_folder)
    assert "cuda.bindings.driver" in modules
