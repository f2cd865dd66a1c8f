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
import time
from pathlib import Path
from typing import Any

import pytest

import aiostream as ais
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
    for strategy in ("quiet", "hybrid", "poll", "thread", "callback"):
        assert proc.stdout.count(f"aiostream {strategy}") == 2, proc.stdout  # sections 1-2
    assert "ratio quiet (the default) / (a) median" in proc.stdout
    assert "(c) anyio.to_thread.run_sync(cuEventSynchronize)" in proc.stdout
    assert "3. waits at scale (quiet)" in proc.stdout
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
    # no budget: every step runs, however busy this machine is
    args = (str(tmp_path), "--quick", "--budget", "0")
    proc = run_on(stand_in_folder, "benchmarks/gpu_suite.py", *args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    assert "- device: the stand-in driver of tests/fake_cuda" in report
    for step in (
        *("info", "short-wait", "cuda-tests", "bench-cuda", "demo-asyncio", "demo-trio"),
        *("bench-server", "contract", "graphs", "bench-graph", "calibrate"),
    ):
        assert re.search(rf"^\| {step} \| passed \|", report, re.MULTILINE), report
        assert (tmp_path / f"{step}.txt").exists()
    # its goals are for GPUs: on the stand-in (a CPU simulation, on a machine maybe busy)
    # the table is made and read, whatever its figures
    assert re.search(r"^\| aiostream-bench \| (passed|goals missed) \|", report, re.M), report
    # the profile it measured, read back; how close its virtual device came (on a busy
    # machine the stand-in's timings may miss the goal: reported, not failed)
    assert ais.virtual.DeviceProfile.load(tmp_path / "profile.json").measured_on == "cuda:0"
    assert re.search(
        r"^\| calibrate-check \| (passed|goals missed) \| .*virtual, this profile", report, re.M
    ), report
    # quick: the conformance suite on cuda:0 alone (CI's CUDA lane runs every cuda test)
    assert re.search(r"^\| cuda-tests \| passed \| [\d.]+ \| \d+ passed", report, re.M), report
    assert re.search(r"^\| bench-torch-loader \| (skipped|passed) \|", report, re.MULTILINE)
    assert re.search(r"^\| interop-pipeline \| skipped \| .* runs no kernels", report, re.M)
    # the foreign handles' benchmark needs no GPU: it runs, and its goals are read
    assert re.search(r"^\| completions \| (passed|goals missed) \| .*goals", report, re.M), report


@pytest.mark.timeout(300)  # its completions step runs: 1,000 waits, gloo and Dask where installed
def test_the_gpu_suite_without_a_driver_marks_the_gpu_steps_not_run(tmp_path: Path) -> None:
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver library")
    proc = run_on(tmp_path, "benchmarks/gpu_suite.py", str(tmp_path / "out"), "--quick")
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- device: no CUDA device: no NVIDIA driver library" in report
    assert re.search(r"^\| info \| passed \|", report, re.MULTILINE), report
    assert re.search(r"^\| completions \| (passed|goals missed) \|", report, re.M), report
    steps: Any = _suite_module().steps(True)  # type: ignore[attr-defined]
    not_run = re.findall(r"^\| ([\w-]+) \| not run \| 0\.0 \| no CUDA device", report, re.M)
    assert not_run == [s.name for s in steps if s.needs_gpu], report  # all but info, completions


def test_a_spent_budget_leaves_steps_out_and_says_so(stand_in_folder: Path, tmp_path: Path) -> None:
    """A lent GPU's minutes are few: with a budget too short for any step, none starts, each
    is marked not run with the reason, and the suite still writes its report."""
    proc = run_on(stand_in_folder, "benchmarks/gpu_suite.py", str(tmp_path), "--budget", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "report.md").read_text()
    spent = re.findall(r"^\| [\w-]+ \| not run \| 0\.0 \| the suite's budget \(1 s\)", report, re.M)
    assert len(spent) == len(_suite_module().steps(False)), report  # type: ignore[attr-defined]
    assert not list(tmp_path.glob("*.txt")), "a step ran"


def test_the_suite_keeps_to_its_budget(stand_in_folder: Path, tmp_path: Path) -> None:
    """With a budget, the suite ends within it (a step at its limit is interrupted, with time
    left to report), and says which steps the budget left out."""
    start = time.monotonic()
    args = (str(tmp_path), "--quick", "--budget", "60")
    proc = run_on(stand_in_folder, "benchmarks/gpu_suite.py", *args, timeout=300)
    took = time.monotonic() - start
    report = (tmp_path / "report.md").read_text()
    assert took < 60 + 15, f"{took:.0f} s for a 60 s budget"  # the interpreter's start beside
    assert re.search(r"^\| info \| passed \|", report, re.M), report
    assert re.search(r"^\| cuda-tests \| (passed|timed out) \|", report, re.M), report
    assert re.search(r"^\| bench-server \| not run \| 0\.0 \| the suite's budget", report, re.M)
    assert proc.returncode in (0, 1), proc.stderr


@pytest.mark.parametrize("budget", ["-1", "nan", "soon"])
def test_a_budget_that_is_no_duration_is_refused(budget: str, tmp_path: Path) -> None:
    proc = run_on(tmp_path, "benchmarks/gpu_suite.py", str(tmp_path / "out"), "--budget", budget)
    assert proc.returncode == 2
    assert "--budget" in proc.stderr
    assert not (tmp_path / "out" / "report.md").exists()


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


@pytest.mark.parametrize(
    ("rc", "verdict", "status"),
    [(1, "2 of 21 goals missed", "goals missed"), (0, "all goals met", "passed")],
)
def test_the_completions_step_says_which_goals_it_missed(
    rc: int, verdict: str, status: str
) -> None:
    suite: Any = _suite_module()
    step = suite.Step("completions", [], 60, needs_gpu=False)
    lines = ["goal trio, 1,000 done() handles, median: 0.66 ms (at most 1): met"]
    if rc:
        lines += [
            "goal trio, 1,000 done() handles, CPU per 1,000 completions: 0.19 CPU-s (at most"
            " 0.15): MISS",
            "goal asyncio, 1,000 handles pending, % of a core: 1.06 % (under 1): MISS",
        ]
    suite.summarize(step, "\n".join(["goals", *lines, verdict]), rc)
    assert step.status == status
    missed = [line.removeprefix("goal ") for line in lines if line.endswith("MISS")]
    assert step.summary == "; ".join([*missed, verdict])


def test_a_step_that_needs_more_than_the_budget_left_is_not_started(tmp_path: Path) -> None:
    """The completions step needs its whole run (cut off, it would count as a failed step):
    with less of the budget left, it is not started, and the report says why."""
    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has an NVIDIA driver library")
    proc = run_on(tmp_path, "benchmarks/gpu_suite.py", str(tmp_path / "out"), "--budget", "100")
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "out" / "report.md").read_text()
    assert re.search(r"^\| info \| passed \|", report, re.MULTILINE), report
    spent = r"^\| completions \| not run \| 0\.0 \| the suite's budget \(100 s\) was spent"
    assert re.search(spent, report, re.MULTILINE), report


def test_the_failed_tests_of_an_interrupted_parallel_run_are_run_again_alone() -> None:
    """What pytest over several processes said failed (ids with spaces too) becomes a step
    of its own that runs those tests again, one process, no parallel plugin."""
    suite: Any = _suite_module()
    # the arguments of a parallel run, whether or not pytest-xdist is installed here
    step = suite.Step("cuda-tests", [sys.executable, *suite.cuda_test_args(False, True)], 60)
    assert "-n" in step.args and "tests/cuda" in step.args
    # a hang inside a driver call ends its worker (and the device work it held), not the run
    assert "--timeout-method=thread" in step.args
    output = "\n".join(
        [
            "[gw0] [ 20%] FAILED tests/cuda/test_a.py::test_x[trio] ",
            "=========================== short test summary info ===",
            "FAILED tests/cuda/test_a.py::test_x[trio] - AssertionError: 1 == 0",
            "FAILED tests/cuda/test_b.py::test_y[asyncio-marker events] - TimeoutError",
            "ERROR tests/cuda/test_c.py::test_z",
            "FAILED tests/cuda/test_a.py::test_x[trio]",
            "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!!!!",
            "=================== 3 failed, 6 passed in 247.88s (0:04:07) ====",
        ]
    )
    assert suite.failed_tests(output) == [
        "tests/cuda/test_a.py::test_x[trio]",
        "tests/cuda/test_b.py::test_y[asyncio-marker events]",
        "tests/cuda/test_c.py::test_z",
    ]
    suite.summarize(step, output, 124)
    assert step.status == "timed out"
    assert step.summary == "3 failed, 6 passed in 247.88s (0:04:07)"
    rerun = suite.rerun_step(step)
    assert rerun is not None and rerun.name == "cuda-reruns"
    assert "-n" not in rerun.args and "tests/cuda" not in rerun.args
    assert "--timeout-method=thread" not in rerun.args  # one process: a timeout fails one test
    assert rerun.args[-3:] == suite.failed_tests(output)
    assert suite.rerun_step(rerun) is None  # the reruns are not run again
    passed = suite.Step("cuda-tests", step.args, 60)
    suite.summarize(passed, "== 710 passed in 200.00s ==", 0)
    assert suite.rerun_step(passed) is None


def test_a_step_at_its_limit_is_interrupted_and_still_reports(tmp_path: Path) -> None:
    """The step gets SIGINT at its limit (pytest then prints what failed), not a kill."""
    suite: Any = _suite_module()
    script = (
        "import time\n"
        "try:\n"
        "    print('working', flush=True); time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    print('FAILED tests/t.py::test_slow - interrupted', flush=True)\n"
    )
    # its limit leaves the interpreter time to start and reach the sleep on a busy machine
    step = suite.Step("cuda-tests", [sys.executable, "-c", script], 10.0)
    suite.run(step, tmp_path)
    assert step.status == "timed out"
    assert step.notes == ["FAILED tests/t.py::test_slow - interrupted"]
    assert step.seconds < 10.0 + suite.INTERRUPT_GRACE
    assert "working" in (tmp_path / "cuda-tests.txt").read_text()


def test_a_step_at_its_limit_is_stopped_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose process started others (pytest's workers, programs it spawned): at the
    limit the whole group is interrupted, and a child that holds the output pipe cannot hold
    the suite past its budget."""
    suite: Any = _suite_module()
    monkeypatch.setattr(suite, "INTERRUPT_GRACE", 2.0)
    script = (
        "import subprocess, time\n"
        "subprocess.Popen(['sleep', '60'])  # inherits the output pipe\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    step = suite.Step("bench-cuda", [sys.executable, "-c", script], 5.0)
    suite.run(step, tmp_path)
    assert step.status == "timed out"
    assert step.seconds < 5.0 + 2.0 + 10.0, step.seconds  # not the child's 60 s
    assert "started" in (tmp_path / "bench-cuda.txt").read_text()


def test_the_bench_steps_summary_is_its_cuda_rows_and_verdict() -> None:
    suite: Any = _suite_module()
    step = suite.Step("aiostream-bench", [], 60)
    table = (
        "measure (aiostream / baseline)\n"
        "core: await a complete event / a bare checkpoint\n"
        "  asyncio  5,000 awaits        9.5 us     7.7 us    1.24  <= 1.5         ok\n"
        "cuda: await of a 20 us kernel / cuEventSynchronize in a thread\n"
        "  asyncio  1,000 awaits       29.3 us    33.8 us    0.87  <= 1.5         ok\n"
        "\nevery goal met"
    )
    suite.summarize(step, table, 0)
    assert step.status == "passed"
    assert step.summary == (
        "cuda: await of a 20 us kernel / cuEventSynchronize in a thread asyncio  1,000 awaits"
        "       29.3 us    33.8 us    0.87  <= 1.5         ok; every goal met"
    )
