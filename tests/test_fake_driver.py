"""The CUDA backend's own control flow on machines without a GPU.

The machine's C compiler builds ``tests/fake_cuda/fake_cuda.c`` into a stand-in ``libcuda.so.1``
(the driver entry points the backend uses, in memory on the CPU). Each test runs Python in a
subprocess whose ``LD_LIBRARY_PATH`` points at it, as the driver is looked up when the process
starts: detection, the CUDA tests of ``test_cuda.py`` and the conformance suite on ``cuda:0``
(on asyncio, uvloop and trio), and releasing everything at interpreter exit.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import ROOT, run_python

SOURCE = ROOT / "tests" / "fake_cuda" / "fake_cuda.c"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or importlib.util.find_spec("cuda.bindings") is None,
    reason="the stand-in driver is a Linux shared library used through cuda-python",
)


@pytest.fixture(scope="session")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the stand-in libcuda.so.1, built for this session."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler (cc or gcc) to build the stand-in driver")
    folder = tmp_path_factory.mktemp("fake_cuda")
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O1",
            "-o",
            str(folder / "libcuda.so.1"),
            str(SOURCE),
            "-lpthread",
        ],
        check=True,
        capture_output=True,
    )
    return folder


def run(
    folder: Path | None, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` with the stand-in (or, with None, no driver at all) on the path."""
    if folder is not None:
        env["LD_LIBRARY_PATH"] = str(folder)
    return run_python(*args, timeout=timeout, **env)


DETECT = """
import aiostream as ais
print("available", ais.is_available("cuda"))
print("default", ais.device())
try:
    ais.Stream("cuda:0")
except ais.BackendUnavailableError as exc:
    print("refused", exc)
"""


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"FAKE_CUDA_DEVICES": "0"}, "the NVIDIA driver found no CUDA device"),
        ({"FAKE_CUDA_STUB": "1"}, "stub library, not a driver"),
    ],
    ids=["no-device", "stub-driver"],
)
def test_detection_falls_back_to_virtual_and_says_why(
    stand_in: Path, env: dict[str, str], reason: str
) -> None:
    proc = run(stand_in, "-c", DETECT, **env)
    assert proc.returncode == 0, proc.stderr
    assert "available False" in proc.stdout
    assert "default virtual:0" in proc.stdout
    assert "refused the 'cuda' backend is unavailable: " in proc.stdout
    assert reason in proc.stdout
    info = run(stand_in, "-m", "aiostream", "info", **env)
    assert info.returncode == 0, info.stderr
    assert re.search(r"cuda +unavailable: .*" + re.escape(reason), info.stdout), info.stdout


def test_a_working_driver_is_the_default_device(stand_in: Path) -> None:
    proc = run(stand_in, "-c", DETECT)
    assert proc.returncode == 0, proc.stderr
    assert "available True\ndefault cuda:0\n" in proc.stdout
    info = run(stand_in, "-m", "aiostream", "info")
    assert re.search(r"cuda +available, 1 device: cuda:0", info.stdout), info.stdout


def test_no_driver_library_is_reported(tmp_path: Path) -> None:
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver library, so its absence cannot be shown")
    proc = run(tmp_path, "-c", DETECT)
    assert proc.returncode == 0, proc.stderr
    assert "default virtual:0" in proc.stdout
    assert "no NVIDIA driver library (libcuda.so.1) could be loaded" in proc.stdout


def test_missing_cuda_python_is_reported() -> None:
    code = "import sys; sys.modules['cuda.bindings'] = None\n" + DETECT
    proc = run(None, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert (
        "cuda-python is not installed" in proc.stdout and "pip install cuda-python" in proc.stdout
    )


@pytest.mark.parametrize("devices", [1, 2])
def test_cuda_suites_pass_on_the_stand_in(stand_in: Path, devices: int) -> None:
    """test_cuda.py, the contract and waits suites, the stand-in's own tests and the
    conformance suite on cuda:0, on every loop, with one and two devices: only tests that need
    two devices may skip, and the stand-in's exit report (violations, leaks, live handles) must
    be clean."""
    proc = run(
        stand_in,
        "-m",
        "pytest",
        "-v",
        "-rs",
        "-p",
        "no:cacheprovider",
        "tests/test_cuda.py",
        "tests/test_cuda_contract.py",
        "tests/test_cuda_waits.py",
        "tests/test_stand_in_driver.py",
        "tests/test_conformance.py",
        "tests/test_dlpack.py",
        "tests/test_interop_peers.py",
        "-k",
        "cuda or test_cuda or test_stand_in_driver",
        timeout=600,
        FAKE_CUDA_DEVICES=str(devices),
    )
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "fake_cuda: at exit" not in proc.stderr, proc.stderr[-3000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))  # type: ignore[union-attr]
    assert passed >= (180 if devices == 1 else 190), summary
    skips = re.findall(r"^SKIPPED \[\d+\] .*$", proc.stdout, re.MULTILINE)
    if devices == 2:
        assert not skips, skips
    else:
        assert skips and all("two" in line for line in skips), skips
    for loop in ("asyncio", "uvloop", "trio"):
        if loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            continue
        assert f"[{loop}-cuda:0] PASSED" in proc.stdout, f"no conformance test ran on {loop}"


AT_EXIT = """
import atexit, ctypes, gc, sys, threading
lib = ctypes.CDLL("libcuda.so.1")
lib.fake_cuda_live.restype = lib.fake_cuda_violations.restype = ctypes.c_long

def report():  # registered first, so it runs last, after aiostream's own clean-up
    live = [lib.fake_cuda_live(kind) for kind in range(6)]
    print("live", live, "violations", lib.fake_cuda_violations(), flush=True)

atexit.register(report)
import anyio
import aiostream as ais

async def main():
    s = ais.Stream("cuda:0")
    ais.delay(0.01, stream=s)
    await s.record_event().synchronize(strategy="thread")
    return s

kept = [anyio.run(main), ais.Event("cuda:0", enable_timing=True),
        ais.HostBuffer(64, device="cuda:0")]
kept[1].record(kept[0])
view = kept[2].numpy()
ais.delay(0.01, stream=kept[0])
dropped = [ais.Stream("cuda:0") for _ in range(5)] + [ais.HostBuffer(64, device="cuda:0")]
worker = threading.Thread(target=lambda: (dropped.clear(), gc.collect()))
worker.start(); worker.join()
# nothing pending at exit: work still pending leaves its context to the exit, by design
# (test_cuda_contract's exit tests); here every handle must be released
kept[0].synchronize_blocking()
if sys.argv[1] == "dropped":
    del kept[2], view
    gc.collect()
print("ok", flush=True)
"""


@pytest.mark.parametrize("buffer", ["held", "dropped"])
def test_everything_is_released_once_at_interpreter_exit(stand_in: Path, buffer: str) -> None:
    """Each with its context current (the module too), from any thread, and the stand-in's own
    exit report is clean (it fails the process on a violation, leak or live handle). A host
    buffer the program still holds at exit (a view of it, which a later atexit handler may
    read) is not freed: it keeps its context, which the process's end frees."""
    proc = run(stand_in, "-c", AT_EXIT, buffer)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout
    # Streams, events, contexts, pinned host buffers, device buffers and modules: every handle
    # released, the contexts last (a handle released after them counts as a violation), and
    # nothing twice.
    live = "0, 0, 1, 1" if buffer == "held" else "0, 0, 0, 0"
    assert f"live [{live}, 0, 0] violations 0" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr


def test_the_cuda_benchmark_runs_on_the_stand_in(stand_in: Path) -> None:
    """End to end, tiny sizes; figures from a stand-in driver mean nothing and are not judged."""
    proc = run(stand_in, "benchmarks/bench_cuda.py", "--quick", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "aiostream fake GPU 0" in proc.stdout
    for strategy in ("hybrid", "poll", "thread", "callback"):
        assert proc.stdout.count(f"aiostream {strategy}") == 2, proc.stdout  # sections 1-2
    assert "ratio hybrid / (a) median" in proc.stdout
    assert "(c) anyio.to_thread.run_sync(cuEventSynchronize)" in proc.stdout
    assert "3. waits at scale (hybrid)" in proc.stdout
    rows = re.findall(r"^ +100 +10 (\w+) ", proc.stdout, re.MULTILINE)
    assert set(rows) >= {"asyncio", "trio"}, proc.stdout  # a row per loop


def test_the_gpu_suite_runs_end_to_end_on_the_stand_in(stand_in: Path, tmp_path: Path) -> None:
    """benchmarks/gpu_suite.py, small sizes: every step runs, the report says it is the
    stand-in, and the tests that need a real GPU are listed as skipped with their reason."""
    for dist in ("fastapi", "uvicorn", "httpx"):  # its bench-server step runs the server
        pytest.importorskip(dist, reason='the GPU suite needs pip install -e ".[server]"')
    proc = run(stand_in, "benchmarks/gpu_suite.py", str(tmp_path), "--quick", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    assert "- device: the stand-in driver of tests/fake_cuda" in report
    for step in (
        *("info", "cuda-tests", "bench-cuda", "demo-asyncio", "demo-trio"),
        *("aiostream-bench", "bench-server", "contract"),
    ):
        assert re.search(rf"^\| {step} \| passed \|", report, re.MULTILINE), report
        assert (tmp_path / f"{step}.txt").exists()
    assert "needs a real GPU: the stand-in driver runs no kernels" in report
    assert re.search(r"^\| bench-torch-loader \| (skipped|passed) \|", report, re.MULTILINE)
    assert re.search(r"^\| interop-pipeline \| skipped \| .* runs no kernels", report, re.M)


def test_the_gpu_suite_without_a_driver_marks_the_gpu_steps_not_run(tmp_path: Path) -> None:
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver library")
    proc = run(tmp_path, "benchmarks/gpu_suite.py", str(tmp_path / "out"), "--quick")
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- device: no CUDA device: no NVIDIA driver library" in report
    assert re.search(r"^\| info \| passed \|", report, re.MULTILINE), report
    assert (
        len(re.findall(r"^\| [\w-]+ \| not run \| 0\.0 \| no CUDA device", report, re.MULTILINE))
        == 10
    ), report


def test_the_gpu_contract_scenarios_run_on_the_stand_in(stand_in: Path) -> None:
    """benchmarks/gpu_contract.py with two stand-in devices: every scenario that needs neither
    PyTorch nor a real GPU passes; the PyTorch ones skip and say why."""
    proc = run(stand_in, "benchmarks/gpu_contract.py", timeout=300, FAKE_CUDA_DEVICES="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("context-kept", "host-view", "exit", "fault-exit", "cross-device-copy"):
        assert re.search(rf"^{name}: passed, ", proc.stdout, re.MULTILINE), proc.stdout
    for name in ("loader-sync-debug", "loader-sanitizer"):
        assert re.search(rf"^{name}: skipped, needs PyTorch", proc.stdout, re.MULTILINE)
    assert proc.stdout.strip().endswith("contract: 5 passed, 2 skipped, 0 failed")


def test_the_gpu_contract_scenarios_compile() -> None:
    """Their sources, PyTorch ones included, are at least valid Python here."""
    spec = importlib.util.spec_from_file_location(
        "gpu_contract", ROOT / "benchmarks/gpu_contract.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("CONTEXT_KEPT", "HOST_VIEW", "EXIT", "FAULT_EXIT", "CROSS_DEVICE", "LOADER_TORCH"):
        source = getattr(module, name)
        if name == "FAULT_EXIT":
            source = module.TRAP_PTX + source
        compile(textwrap.dedent(module.PRELUDE) + textwrap.dedent(source), name, "exec")


NVTX = """
import sys, types
sys.modules["nvtx"] = types.ModuleType("nvtx")
import aiostream as ais
from aiostream import _hooks
ais.Stream("virtual:0")
print("virtual", _hooks.nvtx is None)
ais.Stream("cuda:0")
print("cuda", _hooks.nvtx is sys.modules["nvtx"])
"""


def test_the_cuda_backend_turns_nvtx_on_where_installed(stand_in: Path) -> None:
    proc = run(stand_in, "-c", NVTX)
    assert proc.returncode == 0, proc.stderr
    assert "virtual True\ncuda True\n" in proc.stdout, proc.stdout
