"""The benchmarks and the GPU suite run end to end on the stand-in driver, small sizes: every
step runs and the report says it is the stand-in. Figures from a CPU simulation mean nothing
and are never judged here.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.fake_cuda import run_on
from tests.helpers.process import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or importlib.util.find_spec("cuda.bindings") is None,
        reason="the stand-in driver is a Linux shared library used through cuda-python",
    ),
]


def test_the_cuda_benchmark_runs_on_the_stand_in(stand_in_folder: Path) -> None:
    """End to end, tiny sizes; figures from a stand-in driver mean nothing and are not judged."""
    proc = run_on(stand_in_folder, "benchmarks/bench_cuda.py", "--quick", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "aiostream fake GPU 0" in proc.stdout
    for strategy in ("hybrid", "poll", "thread", "callback"):
        assert proc.stdout.count(f"aiostream {strategy}") == 2, proc.stdout  # sections 1-2
    assert "ratio hybrid / (a) median" in proc.stdout
    assert "(c) anyio.to_thread.run_sync(cuEventSynchronize)" in proc.stdout
    assert "3. waits at scale (hybrid)" in proc.stdout
    rows = re.findall(r"^ +100 +10 (\w+) ", proc.stdout, re.MULTILINE)
    assert set(rows) >= {"asyncio", "trio"}, proc.stdout  # a row per loop


@pytest.mark.timeout(660)  # the suite's own limit (600 s) comes first, with its report
def test_the_gpu_suite_runs_end_to_end_on_the_stand_in(
    stand_in_folder: Path, tmp_path: Path
) -> None:
    """benchmarks/gpu_suite.py, small sizes: every step runs, the report says it is the
    stand-in, and the steps that need a real GPU say so."""
    for dist in ("fastapi", "uvicorn", "httpx"):  # its bench-server step runs the server
        pytest.importorskip(dist, reason='the GPU suite needs pip install -e ".[server]"')
    proc = run_on(stand_in_folder, "benchmarks/gpu_suite.py", str(tmp_path), "--quick", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    assert "- device: the stand-in driver of tests/fake_cuda" in report
    for step in (
        *("info", "cuda-tests", "bench-cuda", "demo-asyncio", "demo-trio"),
        *("bench-server", "contract", "graphs", "bench-graph"),
    ):
        assert re.search(rf"^\| {step} \| passed \|", report, re.MULTILINE), report
        assert (tmp_path / f"{step}.txt").exists()
    # its goals are for GPUs: on the stand-in (a CPU simulation, on a machine maybe busy)
    # the table is made and read, whatever its figures
    assert re.search(r"^\| aiostream-bench \| (passed|goals missed) \|", report, re.M), report
    # quick: the conformance suite on cuda:0 alone (CI's CUDA lane runs every cuda test)
    assert re.search(r"^\| cuda-tests \| passed \| [\d.]+ \| \d+ passed", report, re.M), report
    assert re.search(r"^\| bench-torch-loader \| (skipped|passed) \|", report, re.MULTILINE)
    assert re.search(r"^\| interop-pipeline \| skipped \| .* runs no kernels", report, re.M)


def test_the_gpu_suite_without_a_driver_marks_the_gpu_steps_not_run(tmp_path: Path) -> None:
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver library")
    proc = run_on(tmp_path, "benchmarks/gpu_suite.py", str(tmp_path / "out"), "--quick")
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- device: no CUDA device: no NVIDIA driver library" in report
    assert re.search(r"^\| info \| passed \|", report, re.MULTILINE), report
    assert (
        len(re.findall(r"^\| [\w-]+ \| not run \| 0\.0 \| no CUDA device", report, re.MULTILINE))
        == 12
    ), report


def test_the_gpu_contract_scenarios_run_on_the_stand_in(stand_in_folder: Path) -> None:
    """benchmarks/gpu_contract.py with two stand-in devices: every scenario that needs neither
    PyTorch nor a real GPU passes; the PyTorch ones skip and say why."""
    proc = run_on(stand_in_folder, "benchmarks/gpu_contract.py", timeout=300, FAKE_CUDA_DEVICES="2")
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


def _suite_module() -> object:
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks/gpu_suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("tail", "status"),
    [
        ("", "goals missed"),
        # the stand-in's exit report, on stderr, comes after the verdict: still the verdict
        (
            "\nfake_cuda: at exit: 0 violation(s), 1 handle(s) leaked at a context reset",
            "goals missed",
        ),
        ("\nfake_cuda: violation: cuEventQuery of a destroyed event", "failed (exit 1)"),
    ],
)
def test_a_benchmark_goal_missed_is_not_a_failed_step(tail: str, status: str) -> None:
    suite: Any = _suite_module()
    step = suite.Step("aiostream-bench", [], 60)
    suite.summarize(step, "measure (aiostream / baseline)\n\n1 of 12 goals missed" + tail, 1)
    assert step.status == status
