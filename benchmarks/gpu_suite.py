"""The GPU suite: everything that proves the CUDA backend on a GPU, in one run, with a report.

Usage: python benchmarks/gpu_suite.py OUTDIR [--quick]   (``gpu_suite.sh`` installs, then calls it)

Writes ``OUTDIR/report.md`` (the machine, the GPU and its driver, the date, one row per step)
and each step's raw output as ``OUTDIR/<step>.txt``. The steps:

1. ``info``: ``python -m aiostream info``.
2. ``cuda-tests``: ``tests/test_cuda.py``, ``tests/test_cuda_contract.py`` (the driver's
   contract: contexts, memory lifetimes, stream order, faults and exit), the conformance suite
   on ``cuda:0`` and
   ``tests/test_gpu_interop.py`` (PyTorch, CuPy and cuda.core interop, an interprocess event
   awaited in a spawned child, a trapping kernel), on asyncio, uvloop and trio; every skip is
   listed with its reason.
3. ``bench-cuda``: ``benchmarks/bench_cuda.py``, each wait strategy's latency and CPU against
   ``cuEventSynchronize`` in a thread and ``asyncio.to_thread(torch_event.synchronize)``, and
   1,000 concurrent awaits on 100 streams.
4. ``demo-<loop>``: ``python -m aiostream demo --device cuda:0`` on each loop.
5. ``bench-torch-loader``: PyTorch's DataLoader beside aiostream's on ``cuda:0``.
6. ``aiostream-bench``: ``python -m aiostream bench --sections core,cuda``, the table a user
   gets, with the CUDA row.
7. ``bench-server``: ``benchmarks/bench_server.py --device cuda:0``, the inference server
   example on the GPU (needs fastapi, uvicorn and httpx: ``gpu_suite.sh`` installs them from
   ``.whl/``).
8. ``contract``: ``benchmarks/gpu_contract.py``, the driver's contract on hardware: the caller's
   current context kept, a HostBuffer view after collection, exit within 1 s with a 60 s
   kernel pending, a faulted kernel with no traceback at exit, a cross-device copy, and the
   DataLoader feeding PyTorch kernels under ``set_sync_debug_mode("error")`` and PyTorch's
   CUDA stream sanitizer.

Without a CUDA device, steps 2-5 are marked "not run" with the reason. Against the stand-in
driver of the tests (``tests/fake_cuda``) everything runs, and the report says that its figures
describe a CPU simulation, not a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ("asyncio", "uvloop", "trio")


@dataclass
class Step:
    name: str
    args: list[str]
    timeout: float
    needs_gpu: bool = True
    status: str = "not run"
    seconds: float = 0.0
    summary: str = ""
    notes: list[str] = field(default_factory=list)


def steps(quick: bool) -> list[Step]:
    py = sys.executable
    q = ["--quick"] if quick else []
    out = [
        Step("info", [py, "-m", "aiostream", "info"], 120, needs_gpu=False),
        Step(
            "cuda-tests",
            [
                py,
                "-m",
                "pytest",
                "-v",
                "-rs",
                "-p",
                "no:cacheprovider",
                "tests/test_cuda.py",
                "tests/test_cuda_contract.py",
                "tests/test_cuda_waits.py",
                "tests/test_conformance.py",
                "tests/test_gpu_interop.py",
                "-k",
                "cuda or test_cuda or test_gpu_interop",
            ],
            540,
        ),
        Step("bench-cuda", [py, "benchmarks/bench_cuda.py", *q], 540),
    ]
    batches = ["--batches", "20"] if quick else []
    for loop in LOOPS:
        out.append(
            Step(
                f"demo-{loop}",
                [py, "-m", "aiostream", "demo", "--device", "cuda:0", "--loop", loop, *batches],
                240,
            )
        )
    out.append(Step("bench-torch-loader", [py, "benchmarks/bench_torch_loader.py", *q], 540))
    sections = ["--sections", "core,cuda"]
    out.append(Step("aiostream-bench", [py, "-m", "aiostream", "bench", *sections, *q], 300))
    bounds = ["--bounds", "400,3200"] + (["--quick"] if quick else [])
    server = [py, "benchmarks/bench_server.py", "--device", "cuda:0", *bounds]
    out.append(Step("bench-server", server, 300))
    out.append(Step("contract", [py, "benchmarks/gpu_contract.py"], 540))
    return out


def cuda_state() -> tuple[bool, str]:
    """(whether steps that need a GPU can run, what the report says of the device)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from aiostream import _backends; ok, why = _backends.probe('cuda'); "
            "print('ok' if ok else 'no', why or '')",
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
    try:
        if hasattr(ctypes.CDLL("libcuda.so.1"), "fake_cuda_live"):
            return True, (
                "the stand-in driver of tests/fake_cuda (a CPU simulation): its "
                "figures are not GPU figures and are not to be recorded as such"
            )
    except OSError:
        pass
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
    else:
        step.status = "passed" if rc == 0 else f"failed (exit {rc})"
    if step.name == "cuda-tests":
        step.summary = last.strip("= ")
        step.notes = [line for line in lines if line.startswith("SKIPPED")]
        step.notes += [line for line in lines if line.startswith("FAILED")]
    elif step.name == "aiostream-bench":
        step.summary = "; ".join(line for line in lines if line.startswith("| cuda:"))
    elif step.name == "contract":
        step.summary = last
        step.notes = [line for line in lines if ": failed," in line or ": skipped," in line]
    elif step.name.startswith("demo-"):
        keep = ("overlap efficiency", "speed-up", "bottleneck")
        step.summary = "; ".join(line for line in lines if line.startswith(keep))
    else:
        step.summary = last


def run(step: Step, outdir: Path) -> None:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("AIOSTREAM_DEVICE", None)
    try:
        proc = subprocess.run(
            step.args, cwd=ROOT, capture_output=True, text=True, timeout=step.timeout, env=env
        )
        output, rc = proc.stdout + ("\n" + proc.stderr if proc.stderr else ""), proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = (
            (exc.stdout or b"").decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else (exc.stdout or "")
        )
        rc, step.status = 124, "timed out"
    step.seconds = time.perf_counter() - start
    (outdir / f"{step.name}.txt").write_text(f"$ {' '.join(step.args)}\n\n{output}")
    summarize(step, output, rc)


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
    args = parser.parse_args()
    args.outdir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    gpu, device = cuda_state()
    all_steps = steps(args.quick)
    for step in all_steps:
        if step.needs_gpu and not gpu:
            step.summary = device
            continue
        print(f"gpu_suite: {step.name} ...", flush=True)
        step.status = "running (or cut off)"
        report(args.outdir, device, all_steps, started)  # a run cut short still leaves one
        run(step, args.outdir)
        print(f"gpu_suite: {step.name}: {step.status} ({step.seconds:.1f} s)", flush=True)
    print(report(args.outdir, device, all_steps, started))
    failed = [s.name for s in all_steps if s.status not in ("passed", "skipped", "not run")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
