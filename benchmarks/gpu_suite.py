"""The GPU suite: everything that proves the CUDA backend on a GPU, in one run, with a report.

Usage: python benchmarks/gpu_suite.py OUTDIR [--quick] [--budget SECONDS]
(``gpu_suite.sh`` installs, then calls it)

Writes ``OUTDIR/report.md`` (the machine, the GPU and its driver, the date, one row per step)
and each step's raw output as ``OUTDIR/<step>.txt``. A GPU is lent for minutes, so the suite
keeps to a budget (``--budget``, 420 s by default, 0 for none): each step gets at most what is
left of it, and the steps it leaves out are marked "not run" with the reason. The steps, most
telling first:

1. ``info``: ``python -m aiostream info``.
   ``short-wait``: ``bench_cuda.py`` section 0, the await of pending 0.2 and 2 ms kernels
   against ``cuEventSynchronize`` on each loop, driver calls and host functions per wait.
2. ``graphs``: ``benchmarks/gpu_graphs.py``: ``torch.cuda.graph`` (global mode) capturing on
   a second thread beside 100 pending aiostream waits, for each wait strategy; an aiostream
   graph replayed 1,000 times; two streams' kernels beside 1,000 waits pending on 4 and on
   32 other streams, each way a wait can pend (whether the device holds other streams'
   work, or only its wake-ups, behind aiostream's marks and host functions).
3. ``cuda-tests``: every test marked ``cuda`` (``pytest -m cuda``): ``tests/cuda/`` (the
   driver's contract: contexts, memory lifetimes, stream order, faults and exit; the waits;
   CUDA graphs captured beside aiostream), the white-box tests of the CUDA backend
   (``tests/internals/cuda``), the conformance suite on ``cuda:0``, and
   ``tests/interop/test_gpu_interop.py`` (PyTorch, CuPy and cuda.core interop, an
   interprocess event awaited in a spawned child, a trapping kernel), on asyncio, uvloop and
   trio, over half the cores' processes (2 to 8) where pytest-xdist is installed (at most
   half the budget); every skip is listed with its reason. With ``--quick``, the conformance
   suite on ``cuda:0`` alone. A step at its limit is interrupted, so pytest still prints its
   failures. ``cuda-reruns``, where tests failed over several processes: those tests again,
   one at a time (a test that passes alone was disturbed by another's use of the GPU).
4. ``contract``: ``benchmarks/gpu_contract.py``, the driver's contract on hardware: the caller's
   current context kept, a HostBuffer view after collection, exit within 1 s with a 60 s
   kernel pending, a faulted kernel with no traceback at exit, a cross-device copy, and the
   DataLoader feeding PyTorch kernels under ``set_sync_debug_mode("error")`` and PyTorch's
   CUDA stream sanitizer.
5. ``interop-pipeline``: ``gpu_suite.py --pipeline``, buffers handed over with DLPack and
   events, PyTorch -> aiostream -> CuPy (and JAX where installed), each on its own stream,
   under ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronization by PyTorch),
   the data checked at the end, on asyncio, uvloop and trio; then the same hand-off between
   two processes with ``DeviceBuffer.ipc_handle()``. It says "skipped" with the reason where
   PyTorch, CuPy or a GPU is missing.
6. ``bench-cuda``: ``benchmarks/bench_cuda.py``, each wait strategy's latency and CPU against
   ``cuEventSynchronize`` in a thread and ``asyncio.to_thread(torch_event.synchronize)``, and
   1,000 concurrent awaits on 100 streams.
7. ``bench-graph``: ``benchmarks/bench_graph.py --device cuda:0``, a replay against the same
   operations submitted one by one (1 to 1,000 nodes), and an await of a replay.
8. ``aiostream-bench``: ``python -m aiostream bench --sections core,cuda``, the table a user
   gets, with the CUDA row.
9. ``demo-<loop>``: ``python -m aiostream demo --device cuda:0`` on each loop.
10. ``bench-torch-loader``: PyTorch's DataLoader beside aiostream's on ``cuda:0``.
11. ``bench-server``: ``benchmarks/bench_server.py --device cuda:0``, the inference server
   example on the GPU (needs fastapi, uvicorn and httpx: ``gpu_suite.sh`` installs them from
   ``.whl/``).
12. ``completions``: ``benchmarks/bench_completions.py --sizes 1000``, ``await ais.wait()`` of
   other libraries' handles (gloo work, Dask futures where ``.whl/`` brings Dask, futures,
   ``done()`` handles) on each loop, with its goals. It needs no GPU: it is here for the
   lent machine's cores (the figures of a 2-core machine are at the edge of its goals), and
   starts only with 150 s of the budget left.

Without a CUDA device, the steps that need one are marked "not run" with the reason. Against
the stand-in driver of the tests (``tests/fake_cuda``) everything runs, and the report says
that its figures describe a CPU simulation, not a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ("asyncio", "uvloop", "trio")
# every folder of CUDA tests whose imports the device image has (tests/profiler's need the
# OpenTelemetry SDK and prometheus-client, which it lacks); the white-box tests of the CUDA
# backend run there too: their work is held by gates, as on any driver
CUDA_TEST_FOLDERS = ["tests/cuda", "tests/api", "tests/interop", "tests/internals/cuda"]
# a lent GPU's 15 minutes hold the machine's start, the install and one rerun beside this
DEFAULT_BUDGET = 420.0
MIN_STEP = 15.0  # a step given less would only time out
INTERRUPT_GRACE = 20.0  # a step interrupted at its limit has this long to say what it saw
CUDA_TESTS_SHARE = 0.5  # of the budget: the rest is the benchmarks' and the scenarios'
RERUN_LIMIT = 90.0  # the tests that failed, run again alone
# pytest processes sharing the GPU: its tests wait mostly on the device, so half the cores
WORKERS = max(2, min(8, (os.cpu_count() or 4) // 2))


@dataclass
class Step:
    name: str
    args: list[str]
    timeout: float
    needs_gpu: bool = True
    share: float = 1.0  # of the suite's budget, at most
    at_least: float = MIN_STEP  # started only with this much of the budget left
    status: str = "not run"
    seconds: float = 0.0
    summary: str = ""
    notes: list[str] = field(default_factory=list)


def _parallel() -> bool:
    """Whether pytest-xdist is installed (the device image has it; CI need not)."""
    return importlib.util.find_spec("xdist") is not None


def cuda_test_args(quick: bool, parallel: bool | None = None) -> list[str]:
    """pytest's arguments for the cuda-tests step: spread over ``WORKERS`` processes where
    pytest-xdist is installed (``parallel`` None: where it imports), so that the whole driver
    contract fits in the suite's budget."""
    args = ["-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "--run-slow"]
    # a test that hangs on a GPU costs 30 s of a lent machine's minutes, not the default 60
    args += ["--require-cuda", "-m", "cuda", "--tb=short", "--durations=15", "--timeout=30"]
    if quick:
        return args + ["tests/api/test_conformance.py"]
    if parallel if parallel is not None else _parallel():
        # pytest-benchmark (in the image too) warns under xdist, which this suite makes an error
        args += ["-n", str(WORKERS), "--dist", "load", "-p", "no:benchmark"]
        # a test that hangs inside a driver call never returns to Python for a signal: its
        # timeout ends the worker's process instead, and with it the device work it held
        # (a gate left shut would hold every later test of that process); xdist starts another
        # and goes on (tests spread one by one: a file's or a class's scheduling would give
        # the hung test to each new process again)
        args += ["--timeout-method=thread"]
    return args + CUDA_TEST_FOLDERS


def steps(quick: bool, outdir: Path = Path("gpu-suite")) -> list[Step]:
    """The steps, most telling first: a suite cut short by its budget loses benchmarks, not the
    driver's contract."""
    py = sys.executable
    q = ["--quick"] if quick else []
    profile = str(outdir.resolve() / "profile.json")
    calibrate = [py, "-m", "aiostream", "calibrate"]
    out = [
        Step("info", [py, "-m", "aiostream", "info"], 120, needs_gpu=False),
        # the figures users quote first: the short wait's rows (bench_cuda.py section 0)
        Step("short-wait", [py, "benchmarks/bench_cuda.py", "--sections", "0", *q], 120),
        # every test marked cuda (tests/cuda/, the conformance suite on cuda:0, DLPack, the
        # peers' contracts, tests/interop/test_gpu_interop.py), slow ones included; only the
        # folders that hold them are collected (tooling's need what the image lacks).
        # Quick: the conformance suite alone (CI's CUDA lane runs the rest)
        # graphs first: 20-30 s that say whether the device serializes other streams' work
        # behind aiostream's pending waits, the finding that decides the default strategy
        Step("graphs", [py, "benchmarks/gpu_graphs.py"], 240),
        Step("cuda-tests", [py, *cuda_test_args(quick)], 540, share=CUDA_TESTS_SHARE),
        Step("contract", [py, "benchmarks/gpu_contract.py"], 540),
        # the device's profile (outdir/profile.json), then how close its virtual device is
        Step("calibrate", [*calibrate, "--out", profile, *q], 180),
        Step("calibrate-check", [*calibrate, "--check", profile, *q], 120),
        Step("interop-pipeline", [py, "benchmarks/gpu_suite.py", "--pipeline"], 300),
        Step("bench-cuda", [py, "benchmarks/bench_cuda.py", "--sections", "1234567", *q], 540),
        Step("bench-graph", [py, "benchmarks/bench_graph.py", "--device", "cuda:0", *q], 240),
    ]
    table = [py, "-m", "aiostream", "bench", "--sections", "core,cuda", *q]
    out.append(Step("aiostream-bench", table, 300))
    batches = ["--batches", "20"] if quick else []
    for loop in LOOPS:
        demo = [py, "-m", "aiostream", "demo", "--device", "cuda:0", "--loop", loop, *batches]
        out.append(Step(f"demo-{loop}", demo, 240))
    out.append(Step("bench-torch-loader", [py, "benchmarks/bench_torch_loader.py", *q], 540))
    bounds = ["--bounds", "400,3200"] + (["--quick"] if quick else [])
    server = [py, "benchmarks/bench_server.py", "--device", "cuda:0", *bounds]
    out.append(Step("bench-server", server, 300))
    # no GPU needed: the lent machine's cores, for figures a 2-core machine leaves at the edge
    waits = ["--sections", "12", "--loops", "asyncio"] if quick else []
    completions = [py, "benchmarks/bench_completions.py", "--sizes", "1000", *waits]
    # started only with time for its whole run (about 100 s on a 2-core machine): cut off,
    # it would fail the suite for the lack of minutes, not of a GPU
    out.append(Step("completions", completions, 240, needs_gpu=False, at_least=150))
    return out


def failed_tests(output: str) -> list[str]:
    """The node ids of the tests pytest's short summary says failed or errored, in order."""
    seen = re.findall(r"^(?:FAILED|ERROR) (.+?::.+?)(?: - .*)?$", output, re.MULTILINE)
    return list(dict.fromkeys(seen))


def rerun_step(step: Step) -> Step | None:
    """For a cuda-tests step run over several processes, one that runs its failed tests
    again one at a time, alone on the GPU: a test failing only beside others shares the GPU
    badly (or times itself on a GPU others load); one failing alone fails."""
    if step.name != "cuda-tests" or "-n" not in step.args or not step.notes:
        return None
    failed = failed_tests("\n".join(step.notes))
    if not failed:
        return None
    base = step.args[: step.args.index("-n")]
    base = [a for a in base if a != "--durations=15"]
    return Step("cuda-reruns", [*base, "-p", "no:benchmark", *failed], RERUN_LIMIT)


def cuda_state() -> tuple[bool, str]:
    """(whether steps that need a GPU can run, what the report says of the device)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from aiostream import _backends; ok, why = _backends.probe('cuda'); "
            "print('ok' if ok else 'no', why or '')\n"
            "if ok:\n"
            "    from cuda.bindings import driver as d\n"
            "    name = d.cuDeviceGetName(64, d.cuDeviceGet(0)[1])[1]\n"
            "    print(bytes(name).split(b'\\0')[0].decode())",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ok = probe.stdout.startswith("ok")
    if not ok:
        reason = probe.stdout[3:].strip() or probe.stderr.strip()[-500:]
        return False, f"no CUDA device: {reason}"
    stand_in = (
        "the stand-in driver of tests/fake_cuda (a CPU simulation{}): its figures are not GPU "
        "figures and are not to be recorded as such"
    )
    try:
        if hasattr(ctypes.CDLL("libcuda.so.1"), "fake_cuda_live"):
            return True, stand_in.format("")
    except OSError:
        pass
    if "aiostream fake GPU" in probe.stdout:  # built without its hooks: named so all the same
        return True, stand_in.format(", built without its test hooks")
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        q = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if q.returncode == 0 and q.stdout.strip():
            return True, "; ".join(line.strip() for line in q.stdout.strip().splitlines())
    return True, "a CUDA device (nvidia-smi not found: see the info step for its name)"


def summarize(step: Step, output: str, rc: int) -> None:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if rc in (124, -9) or step.status == "timed out":
        step.status = "timed out"
    elif skipped := re.search(r"^[\w.]+: skipped, (.*)$", output, re.MULTILINE):
        step.status = "skipped"  # the whole step said why it could not run
        step.summary = skipped.group(1)
        return
    elif (
        rc == 1
        and "fake_cuda: violation" not in output
        and (
            (
                step.name in ("aiostream-bench", "completions")
                and re.search(r"^\d+ of \d+ goals? missed$", output, re.MULTILINE)
            )
            or (step.name == "calibrate-check" and re.search(r"^goal .*: MISS$", output, re.M))
        )
    ):
        # measured and reported, which is the step's job: a figure off its goal (on a loaded
        # machine, or on the stand-in) is no failure of it. The verdict is looked for in the
        # whole output: the stand-in's exit report (stderr) may come after it
        step.status = "goals missed"
    else:
        step.status = "passed" if rc == 0 else f"failed (exit {rc})"
    if step.name in ("cuda-tests", "cuda-reruns"):
        step.summary = last.strip("= ")
        step.notes = [line for line in lines if line.startswith("SKIPPED")]
        step.notes += [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    elif step.name == "aiostream-bench":
        # the table's CUDA rows (a measure line, then its figures) and the verdict
        pairs = zip(lines, lines[1:], strict=False)  # each line and the next
        cuda = [f"{a} {b.strip()}" for a, b in pairs if a.startswith("cuda: ")]
        step.summary = "; ".join([*cuda, last])
    elif step.name == "contract":
        step.summary = last
        step.notes = [line for line in lines if ": failed," in line or ": skipped," in line]
    elif step.name == "calibrate-check":
        keep = ("  device ", "  virtual, ", "goal ")
        step.summary = "; ".join(" ".join(line.split()) for line in lines if line.startswith(keep))
    elif step.name == "completions":  # the goals it missed, and the verdict
        missed = [line.removeprefix("goal ") for line in lines if line.endswith(": MISS")]
        step.summary = "; ".join([*missed, last])
    elif step.name.startswith("demo-"):
        keep = ("efficiency against the bound", "speed-up", "bottleneck")
        step.summary = "; ".join(line for line in lines if line.startswith(keep))
    else:
        step.summary = last


def run(step: Step, outdir: Path) -> None:
    """Run the step in a process group of its own; at its time limit the group is
    interrupted (SIGINT: pytest then still prints the failures it has seen, with their
    tracebacks, and its workers stop too), and killed 20 s later, children and all."""
    start = time.perf_counter()
    # wide lines: the report reads whole lines of the demo's output
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("AIOSTREAM_DEVICE", None)
    proc = subprocess.Popen(
        step.args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,  # its children (pytest's workers, spawned programs) with it
        # SIGINT as the default, whatever this suite inherited (a background job's is ignored,
        # and a Python started so never raises KeyboardInterrupt: no failures printed)
        preexec_fn=_default_sigint,
    )
    try:
        output, _ = proc.communicate(timeout=step.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=INTERRUPT_GRACE)
        except subprocess.TimeoutExpired as exc:
            _signal_group(proc, signal.SIGKILL)
            try:
                output, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a process of another group holds the pipe
                proc.wait()
                partial = exc.output or b""
                output = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
        rc, step.status = 124, "timed out"
    step.seconds = time.perf_counter() - start
    (outdir / f"{step.name}.txt").write_text(f"$ {' '.join(step.args)}\n\n{output}")
    summarize(step, output, rc)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the group is gone already
        pass


def report(outdir: Path, device: str, all_steps: list[Step], started: datetime.datetime) -> str:
    lines = [
        "# aiostream GPU suite",
        "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        f"- device: {device}",
        "",
        "| step | status | seconds | summary |",
        "|---|---|---|---|",
    ]
    for s in all_steps:
        summary = s.summary.replace("|", "/")
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.1f} | {summary} |")
    for s in all_steps:
        if s.notes:
            lines += ["", f"## {s.name}: skips and failures", ""]
            lines += [f"- {note}" for note in s.notes]
    lines += ["", "Raw outputs: one file per step beside this report.", ""]
    text = "\n".join(lines)
    (outdir / "report.md").write_text(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="where the report and raw outputs go")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes (a smoke run of the suite itself)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        metavar="SECONDS",
        help=f"the whole suite's time (default {DEFAULT_BUDGET:.0f}; 0 for none)",
    )
    args = parser.parse_args()
    if not args.budget >= 0:  # NaN too
        parser.error(f"--budget must be 0 (none) or a number of seconds, not {args.budget}")
    args.outdir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    begun = time.monotonic()  # the budget counts the device's probe too
    gpu, device = cuda_state()
    all_steps = steps(args.quick, args.outdir)
    deadline = begun + args.budget if args.budget else float("inf")
    for step in all_steps:
        if step.needs_gpu and not gpu:
            step.summary = device
            continue
        left = deadline - time.monotonic() - INTERRUPT_GRACE  # an interrupted step reports
        if left < step.at_least:
            step.summary = f"the suite's budget ({args.budget:.0f} s) was spent"
            continue
        share = step.share * args.budget if args.budget else float("inf")
        step.timeout = min(step.timeout, left, share)
        print(f"gpu_suite: {step.name} ...", flush=True)
        step.status = "running (or cut off)"
        report(args.outdir, device, all_steps, started)  # a run cut short still leaves one
        run(step, args.outdir)
        print(f"gpu_suite: {step.name}: {step.status} ({step.seconds:.1f} s)", flush=True)
        if rerun := rerun_step(step):
            all_steps.insert(all_steps.index(step) + 1, rerun)
    print(report(args.outdir, device, all_steps, started))
    ran = ("passed", "goals missed", "skipped", "not run")
    failed = [s.name for s in all_steps if s.status not in ran]
    return 1 if failed else 0


# ---------------------------------------------------------------------- the interop pipeline

PIPELINE_N = 1 << 20  # float32 values handed along


def _skip(why: str) -> int:
    print(f"pipeline: skipped, {why}", flush=True)
    return 0


def _pipeline_ready() -> str | None:
    """Why the pipeline cannot run here, or None."""
    from aiostream import _backends

    ok, why = _backends.probe("cuda")
    if not ok:
        return f"no CUDA device: {why}"
    if hasattr(ctypes.CDLL("libcuda.so.1"), "fake_cuda_live"):
        return "the stand-in driver runs no kernels of other libraries (needs a GPU)"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    return None


def _jax() -> object | None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave PyTorch its memory
    try:
        import jax
        import jax.dlpack

        if not any(d.platform == "gpu" for d in jax.devices()):
            return None
        return jax
    except Exception:  # noqa: BLE001 - not installed, or without its CUDA plugin
        return None


async def _pipeline_once() -> str:
    """PyTorch -> aiostream -> CuPy (-> JAX), each on its own stream, handed over with DLPack
    and events, PyTorch's host synchronizations forbidden; the data checked at the end."""
    import cupy
    import numpy as np
    import torch

    import aiostream as ais

    expected = float(np.arange(PIPELINE_N, dtype=np.float64).sum() * 3 + PIPELINE_N)
    torch_stream = torch.cuda.Stream()
    mine = ais.Stream("cuda:0")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(torch_stream):
            produced = torch.arange(PIPELINE_N, device="cuda", dtype=torch.float32) * 3 + 1
            buf = ais.from_dlpack(produced, stream=mine)  # mine waits for PyTorch's kernels
        del produced  # the buffer holds PyTorch's memory until its work is done
        staged = ais.DeviceBuffer(buf.nbytes, "cuda:0").view(buf.dtype, buf.shape)
        ais.delay(0.05, stream=mine)  # a slow step: an early reader would see no data
        ais.copy_async(staged, buf, stream=mine)
        with cupy.cuda.Stream(non_blocking=True) as cupy_stream:
            consumed = cupy.from_dlpack(staged)  # CuPy's stream waits for the copy
            total = consumed.sum(dtype=cupy.float64)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(cupy_stream)
        await ais.as_event(done).synchronize()  # only this task waits
        back = torch.from_dlpack(staged)  # and back to PyTorch, on its current stream
        checked = back.double().sum()
        torch_done = torch.cuda.Event()
        torch_done.record()
        await ais.as_event(torch_done).synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # (sum, relative tolerance): float64 sums of these integers are exact
    got = [(float(total.get()), 1e-12), (float(checked.item()), 1e-12)]
    hops = "torch -> aiostream -> cupy -> torch"
    jax = _jax()
    if jax is not None:
        array = jax.dlpack.from_dlpack(staged)  # float32 without jax_enable_x64: summed so
        got.append((float(array.sum().block_until_ready()), 1e-4))
        hops += ", aiostream -> jax"
    else:
        hops += " (jax: not installed, or without its GPU plugin)"
    if any(abs(g - expected) > tolerance * expected for g, tolerance in got):
        raise AssertionError(f"{hops}: sums {[g for g, _ in got]}, expected {expected}")
    return f"{hops}: {PIPELINE_N} floats, sums as expected"


_PIPELINE_CHILD_WORK = 0.2  # seconds of the exporter's work before its copy lands


def _pipeline_child(handle_hex: str) -> int:
    """The other process: opens the buffer, reads it through PyTorch, checks the data."""
    import anyio
    import numpy as np
    import torch

    import aiostream as ais

    async def main() -> float:
        opened = ais.DeviceBuffer.from_ipc_handle("cuda:0", bytes.fromhex(handle_hex))
        torch.cuda.set_sync_debug_mode("error")
        try:
            tensor = torch.from_dlpack(opened.view(np.float32))  # PyTorch's stream waits
            total = tensor.double().sum()
            done = torch.cuda.Event()
            done.record()
            await ais.as_event(done).synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return float(total.item())

    got = anyio.run(main)
    expected = float(np.arange(PIPELINE_N, dtype=np.float64).sum() * 3 + PIPELINE_N)
    print(f"child sum {got}, expected {expected}", flush=True)
    return 0 if abs(got - expected) <= 1e-6 * expected else 1


async def _pipeline_ipc() -> str:
    """PyTorch -> aiostream in this process -> another process, over an IPC handle: the child
    starts while this process's copy is still pending, and its stream waits on the device."""
    import anyio
    import torch

    import aiostream as ais

    mine = ais.Stream("cuda:0")
    torch.cuda.set_sync_debug_mode("error")
    try:
        produced = torch.arange(PIPELINE_N, device="cuda", dtype=torch.float32) * 3 + 1
        buf = ais.from_dlpack(produced, stream=mine)
        shared = ais.DeviceBuffer(buf.nbytes, "cuda:0", interprocess=True)
        ais.delay(_PIPELINE_CHILD_WORK, stream=mine)
        ais.copy_async(shared, buf, stream=mine)
        with ais.use_stream(mine):
            handle = shared.ipc_handle()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    child = await anyio.run_process(
        [sys.executable, str(Path(__file__).resolve()), "--pipeline-child", handle.hex()],
        check=False,
    )
    await mine.synchronize()
    out, err = (child.stdout or b"").decode(), (child.stderr or b"").decode()
    if child.returncode != 0 or not out.strip():
        raise AssertionError(f"the child process failed ({child.returncode}): {err[-2000:]}")
    return f"IPC hand-off to another process: {out.strip().splitlines()[-1]}"


def pipeline() -> int:
    why = _pipeline_ready()
    if why is not None:
        return _skip(why)
    import importlib.util

    import anyio

    ran = []
    for loop in LOOPS:
        if loop != "asyncio" and importlib.util.find_spec(loop) is None:
            print(f"pipeline: {loop}: not installed, not run", flush=True)
            continue
        backend = "trio" if loop == "trio" else "asyncio"
        options = {"use_uvloop": True} if loop == "uvloop" else {}
        result = anyio.run(_pipeline_once, backend=backend, backend_options=options)
        print(f"pipeline: {loop}: {result}", flush=True)
        ran.append(loop)
    print(f"pipeline: {anyio.run(_pipeline_ipc)}", flush=True)
    print(f"pipeline passed on {', '.join(ran)}; the IPC hand-off passed", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--pipeline":
        sys.exit(pipeline())
    if len(sys.argv) > 2 and sys.argv[1] == "--pipeline-child":
        sys.exit(_pipeline_child(sys.argv[2]))
    sys.exit(main())
