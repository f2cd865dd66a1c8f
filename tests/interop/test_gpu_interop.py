"""On a real GPU: interop with PyTorch, CuPy and cuda.core, events across processes, a kernel
that traps.

These need an NVIDIA GPU (the stand-in driver runs no kernels of other libraries), and
each library where it is used: every test skips and says why otherwise. The GPU suite
(``benchmarks/gpu_suite.sh``) runs them; their first run on a GPU is their real test.
"""

from __future__ import annotations

import multiprocessing
import textwrap
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from tests.helpers.cuda import TRAP as CUDA_TRAP
from tests.helpers.process import run_python
from tests.helpers.stand_in import OK, REASON, on_the_stand_in


def _real_gpu() -> str | None:
    """Why these tests cannot run here, or None on a real GPU."""
    if not OK:
        return f"needs a CUDA device: {REASON}"
    if on_the_stand_in():
        return "needs a real GPU: the stand-in driver runs no kernels of other libraries"
    return None


_WHY = _real_gpu()
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.cuda,
    pytest.mark.skipif(_WHY is not None, reason=str(_WHY)),
]
DEV = "cuda:0"


def _needs(module: str) -> Any:
    return pytest.importorskip(module, reason=f"needs {module} (pip install {module})")


@pytest.fixture(params=["asyncio", "uvloop", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "uvloop":
        _needs("uvloop")
        return ("asyncio", {"use_uvloop": True})
    if request.param == "trio":
        _needs("trio")
    return request.param


# ---------------------------------------------------------------------------- PyTorch


async def test_a_torch_stream_and_event_awaited_after_a_torch_kernel(anyio_backend: Any) -> None:
    torch = _needs("torch")
    s = torch.cuda.Stream()
    done = torch.cuda.Event()
    with torch.cuda.stream(s):
        x = torch.randn(2048, 2048, device="cuda")
        y = x @ x
    ais.delay(0.05, stream=ais.as_stream(s))  # torch's work is pending when the await starts
    done.record(s)
    await ais.as_event(done).synchronize()
    assert done.query()
    await ais.as_stream(s).synchronize()
    assert s.query()
    assert torch.isfinite(y).all()


async def test_a_torch_kernel_runs_after_an_aiostream_copy(anyio_backend: Any) -> None:
    torch = _needs("torch")
    n = 1 << 20
    host = ais.HostBuffer(n * 4, device=DEV)
    host.numpy(np.float32)[:] = np.arange(n, dtype=np.float32)
    dev = ais.DeviceBuffer(n * 4, DEV)
    copies = ais.Stream(DEV)
    ais.delay(0.05, stream=copies)  # the copy lands late: torch must wait for it
    ais.copy_async(dev, host, stream=copies)
    landed = copies.record_event()
    ts = torch.cuda.Stream()
    ais.as_stream(ts).wait_event(landed)  # torch's stream waits on the device
    with torch.cuda.stream(ts):
        t = torch.as_tensor(dev.view(np.float32), device="cuda")
        doubled = t * 2
    ts.synchronize()
    assert torch.equal(doubled.cpu(), torch.arange(n, dtype=torch.float32) * 2)


async def _filled_buffer(n: int) -> ais.DeviceBuffer:
    host = ais.HostBuffer(n * 4, device=DEV)
    host.numpy(np.float32)[:] = np.arange(n, dtype=np.float32)
    dev = ais.DeviceBuffer(n * 4, DEV)
    ais.copy_async(dev, host)
    await ais.current_stream(DEV).synchronize()
    return dev.view(np.float32, (n,))


async def test_torch_sees_a_device_buffer_without_a_copy(anyio_backend: Any) -> None:
    torch = _needs("torch")
    view = await _filled_buffer(4096)
    t = torch.as_tensor(view, device="cuda")
    assert t.data_ptr() == view.__cuda_array_interface__["data"][0]
    assert torch.equal(t.cpu(), torch.arange(4096, dtype=torch.float32))


async def test_cupy_sees_a_device_buffer_without_a_copy(anyio_backend: Any) -> None:
    cupy = _needs("cupy")
    view = await _filled_buffer(4096)
    c = cupy.asarray(view)
    assert c.data.ptr == view.__cuda_array_interface__["data"][0]
    assert (cupy.asnumpy(c) == np.arange(4096, dtype=np.float32)).all()


# ---------------------------------------------------------------------------- CuPy, cuda.core


async def test_cupy_streams_both_ways(anyio_backend: Any) -> None:
    cupy = _needs("cupy")
    cs = cupy.cuda.Stream(non_blocking=True)
    with cs:
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        b = (a * 3).sum(dtype=cupy.float64)  # exact: a float32 sum of 2**20 values is not
    await ais.as_stream(cs).synchronize()  # through ``ptr``
    assert float(b) == float(3 * np.arange(1 << 20, dtype=np.float64).sum())
    ours = ais.Stream(DEV)
    ext = cupy.cuda.ExternalStream(ours.__cuda_stream__()[1])
    with ext:
        c = cupy.ones(1024, dtype=cupy.float32) * 5
    await ours.synchronize()
    assert float(c.sum()) == 5 * 1024


async def test_cuda_core_streams_both_ways(anyio_backend: Any) -> None:
    try:  # cuda.core's names left .experimental in its later releases
        import cuda.core as core

        core.Device  # noqa: B018
    except (ImportError, AttributeError):
        core = _needs("cuda.core.experimental")
    device = core.Device(0)
    device.set_current()
    theirs = device.create_stream()
    wrapped = ais.as_stream(theirs)  # through ``__cuda_stream__``
    assert wrapped.__cuda_stream__()[1] == int(theirs.handle)
    await wrapped.synchronize()
    ours = ais.Stream(DEV)
    adopted = device.create_stream(ours)  # cuda.core takes our ``__cuda_stream__``
    assert int(adopted.handle) == ours.__cuda_stream__()[1]
    ais.delay(0.01, stream=ours)
    adopted.sync()
    assert ours.query()


# ---------------------------------------------------------------------------- processes


def _child_waits(handle: bytes, out: Any) -> None:
    async def main() -> bool:
        event = ais.Event.from_ipc_handle(DEV, handle)
        await event.synchronize()
        return event.query()

    out.put(anyio.run(main))


async def test_an_interprocess_event_awaited_in_a_spawned_child(anyio_backend: Any) -> None:
    s = ais.Stream(DEV)
    event = ais.Event(DEV, interprocess=True)
    ais.delay(3.0, stream=s)  # longer than the child takes to start
    event.record(s)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child_waits, args=(event.ipc_handle(), out))
    child.start()
    done_in_child = await anyio.to_thread.run_sync(out.get, True, 60)
    await anyio.to_thread.run_sync(child.join, 60)
    assert child.exitcode == 0
    assert done_in_child  # the child's await returned once the parent's work had completed
    assert event.query()


# ---------------------------------------------------------------------------- a fault

TRAP_MAIN = r"""
import anyio, aiostream as ais

async def main():
    s = ais.Stream("cuda:0")
    ais.delay(0.2, stream=s)                       # pending waits are parked on this ...
    events = [s.record_event() for _ in range(5)]
    launch_trap(s)                                 # ... then this traps
    tail = s.record_event()
    results = {}

    async def wait(name, e):
        try:
            with anyio.fail_after(30):  # every wait ends, with its work or the trap's error
                await e.synchronize()
            results[name] = "ok"
        except ais.CudaError as exc:
            results[name] = f"CudaError {exc.code} {exc.name}"

    async with anyio.create_task_group() as tg:
        for i, e in enumerate(events):
            tg.start_soon(wait, f"before{i}", e)
        tg.start_soon(wait, "after", tail)
    for name in sorted(results):
        print(name, results[name])

anyio.run(main)
"""
TRAP = CUDA_TRAP + TRAP_MAIN  # launch_trap() is the helper's


def test_a_trapping_kernel_fails_every_pending_wait_and_never_hangs() -> None:
    """In a fresh process (a trap leaves the context unusable): the wait on work after the
    trap raises the driver's error; waits on work before it complete or raise it; none hangs
    (each has 30 s). Then ``python -m aiostream info`` in a fresh process still works."""
    proc = run_python("-c", textwrap.dedent(TRAP), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert results["after"].startswith("CudaError "), proc.stdout
    assert len(results) == 6 and all(
        r == "ok" or r.startswith("CudaError ") for r in results.values()
    ), proc.stdout
    info = run_python("-m", "aiostream", "info", timeout=120)
    assert info.returncode == 0, info.stderr
    assert "cuda" in info.stdout
