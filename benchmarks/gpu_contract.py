"""The CUDA backend's contract with the driver, proven on hardware: scenarios a GPU shows.

Usage: python benchmarks/gpu_contract.py [--only NAME[,NAME...]]

Each scenario runs in a fresh interpreter (a fault or a crash must not take the others with it)
and prints one line: ``<name>: passed|failed|skipped, <detail>``; the last line counts them, and
the exit status is 1 if any failed. ``gpu_suite.py`` runs it as its ``contract`` step.

1. ``context-kept``: aiostream work leaves the thread's current context as it was:
   ``torch.cuda.current_device()`` is unchanged after work on another device (two GPUs), and
   ``cuCtxGetCurrent()`` after work on cuda:0 (any number).
2. ``host-view``: a numpy view of a HostBuffer, written after the buffer object was collected.
3. ``exit``: the interpreter exits within 1 s of leaving ``main``, with a 60 s kernel pending and
   its wait cancelled (asyncio with ``quiet`` and ``hybrid``, trio with ``thread``).
4. ``fault-exit``: a kernel that traps (the stand-in runs it as a GPU does), objects dropped after
   it: no traceback at exit, at most one line saying what could not be released.
5. ``cross-device-copy``: a HostBuffer of cuda:0 copied to and from cuda:1 (two GPUs).
6. ``loader-sync-debug``: the DataLoader feeding PyTorch kernels on an aiostream stream under
   ``torch.cuda.set_sync_debug_mode("error")``: no host sync anywhere; data checked.
7. ``loader-sanitizer``: the same under PyTorch's CUDA stream sanitizer
   (``TORCH_CUDA_SANITIZER=1``): nothing reported.

Scenarios that need PyTorch or a second GPU say so and skip. On the stand-in driver of the
tests (``tests/fake_cuda``) the ones that need neither run, and it counts every breach of the
driver's contract in its exit report, which this script also reads.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PRELUDE = """
import ctypes, gc, sys, time, threading
import numpy as np, anyio
import aiostream as ais
from cuda.bindings import driver as cu

def skip(why):
    print("SKIP", why, flush=True)
    sys.exit(0)

def stand_in():
    return hasattr(ctypes.CDLL("libcuda.so.1"), "fake_cuda_live")

def torch_or_skip():
    try:
        import torch
    except ImportError:
        skip("needs PyTorch")
    if stand_in() or not torch.cuda.is_available():
        skip("needs PyTorch on a real GPU")
    return torch

def current():
    return int(cu.cuCtxGetCurrent()[1])

from aiostream import _backends
available, why = _backends.probe("cuda")
if not available:
    skip("no CUDA device: " + why)
"""

CONTEXT_KEPT = """
async def work(dev):
    s = ais.Stream(dev)
    host = ais.HostBuffer(1 << 16, device=dev)
    with ais.use_stream(s):
        buf = ais.DeviceBuffer(1 << 16, dev)
    ais.copy_async(buf, host, stream=s)
    ais.delay(0.001, stream=s)
    ais.copy_async(host, buf)
    await s.synchronize()
    await ais.current_stream(dev).synchronize()
    for strategy in ("quiet", "hybrid", "poll", "thread", "callback"):
        ais.delay(0.002, stream=s)
        await s.synchronize(strategy=strategy)
    del buf, host, s
    gc.collect()

before = current()
anyio.run(work, "cuda:0")
assert current() == before, "cuCtxGetCurrent changed by work on cuda:0"
detail = "cuCtxGetCurrent kept"
try:
    import torch
except ImportError:
    torch = None
if torch is not None and torch.cuda.is_available() and torch.cuda.device_count() > 1:
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")
    anyio.run(work, "cuda:1")
    assert torch.cuda.current_device() == 0, torch.cuda.current_device()
    detail += "; torch.cuda.current_device() kept after work on cuda:1"
print("OK", detail, flush=True)
"""

HOST_VIEW = """
view = ais.HostBuffer(1 << 20, device="cuda:0").numpy(np.float32)
gc.collect()
view[:] = 1.0
assert float(view.sum()) == float(1 << 18)
print("OK the view outlived its HostBuffer object and kept the memory", flush=True)
"""

EXIT = """
loop, strategy = sys.argv[1], sys.argv[2]

async def main():
    s = ais.Stream("cuda:0")
    ais.delay(60.0, stream=s)
    with anyio.move_on_after(0.05):
        await s.synchronize(strategy=strategy)
    time.sleep(0.05)

anyio.run(main, backend=loop)
print("LEFT", time.monotonic(), flush=True)
"""

TRAP_PTX = r"""
PTX = b'''
.version 7.0
.target sm_50
.address_size 64
.visible .entry aiostream_trap() { trap; }
''' + b"\0"
"""

FAULT_EXIT = """
s = ais.Stream("cuda:0")
kept = [ais.HostBuffer(64, device="cuda:0"), ais.Event("cuda:0")]
with ais.use_stream(s):
    dev = ais.DeviceBuffer(64, "cuda:0")
dropped = [ais.Stream("cuda:0"), ais.HostBuffer(64, device="cuda:0")]
# the trap kernel, launched through the driver API: a GPU faults on it, and so does the
# stand-in, with or without its hooks
ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1]
cu.cuCtxPushCurrent(ctx)
module = cu.cuModuleLoadData(PTX)[1]
fn = cu.cuModuleGetFunction(module, b"aiostream_trap")[1]
cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, cu.CUstream(s.stream_id), None, 0)
cu.cuCtxPopCurrent()
try:
    s.synchronize_blocking()
except ais.CudaError as exc:
    print("FAULT", exc.name, flush=True)
del dev, s
dropped.clear()
gc.collect()
"""

CROSS_DEVICE = """
if ais.device_count("cuda") < 2:
    skip("needs two GPUs")

async def main():
    up, down = ais.HostBuffer(1 << 20, device="cuda:0"), ais.HostBuffer(1 << 20, device="cuda:0")
    up.numpy(np.float32)[:] = np.arange(1 << 18, dtype=np.float32)
    s1 = ais.Stream("cuda:1")
    with ais.use_stream(s1):
        dev = ais.DeviceBuffer(1 << 20, "cuda:1")
    ais.copy_async(dev, up, stream=s1)
    ais.copy_async(down, dev, stream=s1)
    await s1.synchronize()
    assert (down.numpy(np.float32) == np.arange(1 << 18, dtype=np.float32)).all()

anyio.run(main)
print("OK a HostBuffer of cuda:0 copied to and from cuda:1", flush=True)
"""

LOADER_TORCH = """
torch = torch_or_skip()
sanitizer = sys.argv[1] == "sanitizer"

async def main():
    s = ais.Stream("cuda:0")
    ts = torch.cuda.ExternalStream(s.stream_id)
    items = [np.full((256, 256), i, np.float32) for i in range(32)]
    outs = []
    if not sanitizer:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with ais.use_stream(s), torch.cuda.stream(ts):
            async with ais.DataLoader(items, device="cuda:0", prefetch=4) as loader:
                async for batch in loader:
                    t = torch.as_tensor(batch.data, device="cuda")
                    outs.append((t * 2 + 1).sum())  # kernels on s, which waits for the batch
        await s.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # read on the stream that made them: the sanitizer sees PyTorch's syncs only, not the
    # await above, so a read on another stream would look like a race to it
    with torch.cuda.stream(ts):
        got = [float(o) for o in outs]
    want = [float((2 * i + 1) * 256 * 256) for i in range(32)]
    assert got == want, (got[:4], want[:4])

anyio.run(main)
print("OK 32 batches through PyTorch kernels, data checked", flush=True)
"""

EXIT_LOOPS = [("asyncio", "quiet"), ("asyncio", "hybrid"), ("trio", "thread")]


def python(
    code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    environ.pop("AIOSTREAM_DEVICE", None)
    source = textwrap.dedent(PRELUDE) + textwrap.dedent(code)
    proc = subprocess.run(
        [sys.executable, "-c", source, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=ROOT,
    )
    return proc, time.monotonic()


def judged(proc: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """(status, detail) from a scenario's OK/SKIP line and exit status."""
    ok = re.search(r"^OK (.*)$", proc.stdout, re.MULTILINE)
    skipped = re.search(r"^SKIP (.*)$", proc.stdout, re.MULTILINE)
    if skipped:
        return "skipped", skipped.group(1)
    if proc.returncode != 0 or not ok:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return "failed", f"exit {proc.returncode}: " + " / ".join(tail)
    return "passed", ok.group(1)


def context_kept() -> tuple[str, str]:
    return judged(python(CONTEXT_KEPT)[0])


def host_view() -> tuple[str, str]:
    return judged(python(HOST_VIEW)[0])


def exit_() -> tuple[str, str]:
    took = []
    for loop, strategy in EXIT_LOOPS:
        proc, ended = python(EXIT, loop, strategy, timeout=90)
        left = re.search(r"^LEFT ([\d.]+)$", proc.stdout, re.MULTILINE)
        if proc.returncode != 0 or not left:
            return "failed", f"{loop}/{strategy}: exit {proc.returncode}: {proc.stderr[-300:]}"
        took.append(f"{loop}/{strategy} {ended - float(left.group(1)):.2f} s")
        if ended - float(left.group(1)) >= 1.0:
            return "failed", "exit took " + ", ".join(took)
    return "passed", "exit after main, 60 s kernel pending: " + ", ".join(took)


def fault_exit() -> tuple[str, str]:
    proc, _ = python(TRAP_PTX + FAULT_EXIT)
    if "FAULT" not in proc.stdout:
        return "failed", f"the kernel did not fault: {proc.stdout[-200:]} {proc.stderr[-300:]}"
    lines = proc.stderr.strip().splitlines()
    if proc.returncode != 0 or "Traceback" in proc.stderr or "Exception ignored" in proc.stderr:
        return "failed", f"exit {proc.returncode}: {proc.stderr[-500:]}"
    if len(lines) > 1:
        return "failed", f"{len(lines)} lines at exit: {proc.stderr[-500:]}"
    return "passed", f"no traceback at exit; {lines[0] if lines else 'nothing said'}"


def cross_device_copy() -> tuple[str, str]:
    return judged(python(CROSS_DEVICE)[0])


def loader_sync_debug() -> tuple[str, str]:
    return judged(python(LOADER_TORCH, "sync-debug", timeout=300)[0])


def loader_sanitizer() -> tuple[str, str]:
    proc, _ = python(LOADER_TORCH, "sanitizer", timeout=300, env={"TORCH_CUDA_SANITIZER": "1"})
    status, detail = judged(proc)
    # the sanitizer's own report (both accesses, each with its stack) says what raced
    found = proc.stderr.find("CSAN detected")
    report = proc.stderr[found : found + 4000] if found >= 0 else ""
    if status == "passed" and (report or "data race" in proc.stderr):
        return "failed", report or proc.stderr[-500:]
    return status, f"{detail}\n{report}" if status == "failed" and report else detail


SCENARIOS: dict[str, Callable[[], tuple[str, str]]] = {
    "context-kept": context_kept,
    "host-view": host_view,
    "exit": exit_,
    "fault-exit": fault_exit,
    "cross-device-copy": cross_device_copy,
    "loader-sync-debug": loader_sync_debug,
    "loader-sanitizer": loader_sanitizer,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for name in names:
        try:
            status, detail = SCENARIOS[name]()
        except subprocess.TimeoutExpired as exc:
            status, detail = "failed", f"timed out after {exc.timeout} s"
        counts[status] += 1
        print(f"{name}: {status}, {detail}", flush=True)
    print(
        f"contract: {counts['passed']} passed, {counts['skipped']} skipped, "
        f"{counts['failed']} failed"
    )
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
