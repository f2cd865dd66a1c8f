"""The CUDA backend at close and at the interpreter's exit: close releases every handle it
made (the program's too) and no context with work pending, memory still held is left to the
exit and still reads, every later use raises saying why, a failed release is said once; whole
programs exit at once, without tracebacks, whatever device work is pending.

The close is a backend of the test's own (``own_backend``) closed as the exit closes the
shared one; tests of the exit itself run a program of their own in a subprocess, whose
stand-in driver reports violations and leaks at its exit. Tests that need the stand-in's hooks
skip on a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import (
    CLOSED,
    DEV,
    TRAP,
    N,
    close_with_a_failed_release,
    device_finishes,
    live,
    primary_context,
    program,
    ptr,
    two_devices,
)
from tests.helpers.faults import calls, failing, succeeded
from tests.helpers.gate import gated
from tests.helpers.protocol import STRATEGIES
from tests.helpers.stand_in import FAKE, PINNED, on_the_stand_in

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]

#: the handles aiostream makes, by kind: the driver calls that make one (its handle: the
#: call's first value), and those that release one (its handle: the call's first argument)
HANDLES = {
    "streams": (("cuStreamCreateWithPriority",), ("cuStreamDestroy",)),
    "events": (("cuEventCreate", "cuIpcOpenEventHandle"), ("cuEventDestroy",)),
    "pinned": (("cuMemHostAlloc",), ("cuMemFreeHost",)),
    "device": (("cuMemAllocAsync", "cuMemAlloc"), ("cuMemFreeAsync", "cuMemFree")),
    "modules": (("cuModuleLoadData",), ("cuModuleUnload",)),
}


@contextlib.contextmanager
def handles() -> Iterator[dict[str, list[Any]]]:
    """The calls aiostream makes, during the block, of the entry points that make and release
    its handles (``HANDLES``), as :func:`tests.helpers.faults.calls` sees them, on any driver."""
    names = [name for made, gone in HANDLES.values() for name in (*made, *gone)]
    with calls(*names) as seen:
        yield seen


def unreleased(seen: dict[str, list[Any]]) -> dict[str, int]:
    """Of the handles made while :func:`handles` watched, how many of each kind no release
    seen then took (the kinds with none left out)."""
    left = {}
    for kind, (made, gone) in HANDLES.items():
        given = [int(res[1]) for name in made for _, res in seen[name] if int(res[0]) == 0]
        taken = {int(args[0]) for name in gone for args, res in seen[name] if int(res[0]) == 0}
        if n := sum(1 for handle in given if handle not in taken):
            left[kind] = n
    return left


def releases(seen: dict[str, list[Any]]) -> int:
    """How many releases of a handle :func:`handles` saw succeed."""
    return sum(succeeded(seen[name]) for _, gone in HANDLES.values() for name in gone)


@contextlib.contextmanager
def no_context_released() -> Iterator[None]:
    """The block (a close) releases no primary context (``cuDevicePrimaryCtxRelease``): it
    leaves its reference to the exit; on any driver."""
    with calls("cuDevicePrimaryCtxRelease") as seen:
        yield
    assert seen["cuDevicePrimaryCtxRelease"] == [], seen


def unload_as_the_exit_would(seen: dict[str, list[Any]]) -> None:
    """The modules a close left to the exit (loaded while :func:`handles` watched, never
    unloaded: the sleep kernel's, its work pending at close), unloaded here once the device
    is done, as the exit would: the process's exit finds no module live."""
    device_finishes()
    loaded = [int(res[1]) for _, res in seen["cuModuleLoadData"] if int(res[0]) == 0]
    unloaded = {int(args[0]) for args, res in seen["cuModuleUnload"] if int(res[0]) == 0}
    with primary_context() as cu:
        for module in loaded:
            if module not in unloaded:
                assert cu.cuModuleUnload(cu.CUmodule(module)) == (cu.CUresult.CUDA_SUCCESS,)


def release_as_the_exit_would(index: int = 0) -> None:
    """The reference to device ``index``'s primary context that a close left to the exit,
    released here as the exit would (the shared backend's keeps the context alive)."""
    with primary_context(index) as cu:
        device = cu.cuDeviceGet(index)[1]
        assert cu.cuDevicePrimaryCtxRelease(device) == (cu.CUresult.CUDA_SUCCESS,)


# ----------------------------------------------------------------- close


async def test_close_releases_every_handle_the_backend_made(
    anyio_backend: object, own_backend: Any
) -> None:
    """What runs at exit releases every stream and event (opened from an IPC handle too),
    even those the program still holds, and the buffers, internal stream, markers, flag memory
    and module: every handle the backend made is released (on the stand-in, its counts are
    back where they were), and a second close releases nothing. (A buffer still held at close
    is freed after markers recorded then, which close never waits for: on a loaded machine it
    may be left to the exit, so the test drops it first.)"""
    before = live() if FAKE is not None else []
    with handles() as seen:
        s, t = ais.Stream(DEV), ais.Stream(DEV)
        ipc = ais.Event(DEV, interprocess=True)
        ipc.record(s)
        opened = ais.Event.from_ipc_handle(DEV, ipc.ipc_handle())
        host = ais.HostBuffer(N, device=DEV)
        with ais.use_stream(s):
            shared = ais.DeviceBuffer(N, DEV)
        ais.copy_async(shared, host, stream=t)  # used on two streams: freed on an internal one
        ais.delay(0.001, stream=s)  # the module of the sleep kernel
        with anyio.fail_after(5):
            await s.record_event().synchronize(strategy="thread")  # the watcher and its flags
            await t.synchronize()
        del shared, host
        gc.collect()
        held = own_backend.held(0)
        assert held["streams"] == 1 and held["events"] >= 1, held  # the free stream, markers
        left = unreleased(seen)
        assert left["streams"] == 3 and left["modules"] == 1 and left["events"] >= 3, left
        if FAKE is not None:
            assert live() != before
        # close leaves a context with work pending (a free, a host function) to the exit: let
        # the device finish first, as a program's last synchronize would
        device_finishes()
        own_backend.close()
        assert unreleased(seen) == {}, seen  # the program still holds s, t, ipc, opened
        if FAKE is not None:
            assert live() == before, (before, live())
        released = releases(seen)
        own_backend.close()
        assert releases(seen) == released
        del s, t, ipc, opened
        gc.collect()  # their finalizers release nothing twice (the fixture checks the driver)
        assert releases(seen) == released
    if FAKE is not None:
        assert live() == before


def test_close_leaves_a_context_with_work_pending_on_a_stream_still_held(
    own_backend: Any,
) -> None:
    """Closed while work is pending on a stream the program still holds (aiostream's streams
    are non-blocking: the legacy default stream, idle, says nothing of them), the backend
    destroys its handles but leaves its reference to the context to the exit: releasing it
    could wait for the work, or reset the context under it."""
    s = ais.Stream(DEV)
    refs = FAKE.fake_cuda_context_refs(0) if FAKE is not None else 0
    with handles() as seen, gated(s):
        ais.delay(0.001, stream=s)
        with no_context_released():
            own_backend.close()
        if FAKE is not None:  # kept: the shared backend's and this one's
            assert FAKE.fake_cuda_context_refs(0) == refs
    unload_as_the_exit_would(seen)
    release_as_the_exit_would()  # the shared backend's reference keeps the context alive
    if FAKE is not None:
        assert FAKE.fake_cuda_context_refs(0) == refs - 1
    del s


def test_close_leaves_a_context_with_work_pending_on_a_stream_dropped(own_backend: Any) -> None:
    """Dropped while work is pending, a stream is destroyed at once (the driver lets its work
    run on) and a marker recorded on it first stands for that work: closed meanwhile, with no
    wait anywhere (no completion flag in use), the backend still sees the work through that
    marker and leaves its reference to the context to the exit."""
    s = ais.Stream(DEV)
    refs = FAKE.fake_cuda_context_refs(0) if FAKE is not None else 0
    with handles() as seen, gated(s):
        ais.delay(0.001, stream=s)
        del s
        gc.collect()
        assert own_backend.held(0)["slots"] == 0, own_backend.held(0)
        with no_context_released():
            own_backend.close()
        if FAKE is not None:  # kept: the exit releases it
            assert FAKE.fake_cuda_context_refs(0) == refs
    unload_as_the_exit_would(seen)
    release_as_the_exit_would()
    if FAKE is not None:
        assert FAKE.fake_cuda_context_refs(0) == refs - 1


def test_a_stream_held_past_the_close_refuses_every_use(own_backend: Any) -> None:
    """The close at exit destroys the streams and events the program still holds: their
    later uses raise, saying why, and neither reach the driver nor hand another library a
    handle that names nothing (or another object the driver made since)."""
    s = ais.Stream(DEV)
    event = s.record_event()
    host = ais.HostBuffer(N, device=DEV)
    event.synchronize_blocking()
    del host
    gc.collect()
    device_finishes()
    own_backend.close()
    uses = (
        s.query,
        event.query,
        lambda: s.record_event(),
        lambda: ais.delay(0.001, stream=s),
        s.__cuda_stream__,  # handles for other libraries: destroyed, so none is handed out
        lambda: event.event_id,
    )
    for use in uses:
        with pytest.raises(ais.AiostreamError) as info:
            use()
        assert str(info.value) == CLOSED


def test_memory_still_held_at_close_is_left_to_the_exit_and_still_reads(
    own_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Closed while the program still holds a pinned buffer (and a view of it), the backend
    does not free it, and leaves its reference to the context to the exit: the view reads,
    as an atexit handler registered before aiostream's would read it, and the debug log says
    so. Dropped after the close, it is still not freed: the process's end frees it (here the
    test's own free, which the driver would refuse for memory already freed)."""
    host = ais.HostBuffer(N, device=DEV)
    view = host.numpy()
    address = view.ctypes.data  # the pinned memory's own address
    view[:] = 5
    if FAKE is not None:
        refs, pinned = FAKE.fake_cuda_context_refs(0), FAKE.fake_cuda_live(PINNED)
    with calls("cuMemFreeHost") as freed:
        with caplog.at_level("DEBUG", logger="aiostream"), no_context_released():
            own_backend.close()
        assert (
            "cuda:0: 1 buffer(s) still held at close: left to the exit, with the context"
        ) in caplog.messages
        if FAKE is not None:
            assert FAKE.fake_cuda_context_refs(0) == refs
            assert FAKE.fake_cuda_live(PINNED) == pinned
        assert int(view.sum()) == 5 * N
        del host, view
        gc.collect()
    assert freed["cuMemFreeHost"] == [], freed
    if FAKE is not None:
        assert FAKE.fake_cuda_live(PINNED) == pinned
    # what the exit does, done here (the shared backend's reference keeps the context)
    with primary_context() as cu:
        assert cu.cuMemFreeHost(address) == (cu.CUresult.CUDA_SUCCESS,)
    release_as_the_exit_would()
    if FAKE is not None:
        assert FAKE.fake_cuda_context_refs(0) == refs - 1


@pytest.mark.parametrize("marks", ["flags", "marker events"])
async def test_every_wait_pending_at_close_raises_the_close_and_is_forgotten(
    anyio_backend: object, own_backend: Any, caplog: pytest.LogCaptureFixture, marks: str
) -> None:
    """Closed while awaits of every strategy and blocking waits in threads are pending on a
    held stream (its marks in flag memory, or internal marker events where the device
    writes no values), the backend ends each with the close's error: nothing else raised,
    nothing logged, no wait still listed."""
    s = ais.Stream(DEV)
    outcomes: list[str] = []

    async def wait(event: ais.Event, strategy: str) -> None:
        try:
            await event.synchronize(strategy=strategy)
        except ais.AiostreamError as exc:
            outcomes.append(str(exc))

    def wait_blocking(event: ais.Event) -> None:
        try:
            event.synchronize_blocking()
        except ais.AiostreamError as exc:
            outcomes.append(str(exc))

    with contextlib.ExitStack() as stack:
        seen = stack.enter_context(handles())
        if marks == "marker events":  # the device says it writes no values
            fault = stack.enter_context(failing("cuStreamWriteValue32", code=801))
        stack.enter_context(gated(s))
        ais.delay(0.001, stream=s)
        events = [s.record_event() for _ in range(40)]
        if marks == "marker events":
            assert fault.failed
        threads = [threading.Thread(target=wait_blocking, args=(e,)) for e in events[:4]]
        with caplog.at_level("DEBUG", logger="aiostream"), anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i, event in enumerate(events):
                    tg.start_soon(wait, event, STRATEGIES[i % len(STRATEGIES)])
                for thread in threads:
                    thread.start()
                while len(ais.pending_waits()) < len(events):
                    await anyio.sleep(0.01)
                own_backend.close()
            for thread in threads:
                thread.join(5)
    unload_as_the_exit_would(seen)
    assert outcomes == [CLOSED] * (len(events) + len(threads))
    assert ais.pending_waits() == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed")
        return uvloop.new_event_loop()  # type: ignore[no-any-return]
    return asyncio.new_event_loop()


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])  # trio ends a run's every task
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_wait_whose_loop_closed_is_forgotten_though_its_kernel_hangs(
    own_backend: Any, caplog: pytest.LogCaptureFixture, kind: str, strategy: str
) -> None:
    """``loop.close()`` with a wait pending on a held kernel leaves its task unfinished for
    good: the wait is no longer listed, and the watcher stops watching it (within its health
    check's period) rather than poll for nobody; when the kernel ends nothing is logged."""
    s = ais.Stream(DEV)
    with handles() as seen, gated(s) as release:
        ais.delay(0.001, stream=s)
        loop = _new_loop(kind)
        task = loop.create_task(s.synchronize(strategy=strategy))
        loop.run_until_complete(asyncio.sleep(0.05))
        loop.close()
        with caplog.at_level("DEBUG", logger="aiostream"):
            deadline = time.monotonic() + 5
            while own_backend.held(0)["watched"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert own_backend.held(0)["watched"] == 0
            assert ais.pending_waits() == []
            release()  # the kernel ends: nobody is told, nothing fails
            s.synchronize_blocking()
        # the close at exit, done here: whatever it left to the exit (a completion flag the
        # forgotten wait may still hold) is unloaded as the exit would
        own_backend.close()
    unload_as_the_exit_would(seen)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    del task  # asyncio's own "Task was destroyed but it is pending!" is the program's


# ------------------------------------------------------- failed releases


def test_a_stream_dropped_while_its_context_fails_is_destroyed_and_said_at_close(
    own_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream dropped is asked whether work is pending on it (to keep a marker of that
    work for close), in its context; if the context cannot be made current, the stream is
    destroyed all the same, and close says the failure once, with its call, device and code."""
    streams = FAKE.fake_cuda_live(0) if FAKE is not None else 0
    with handles() as seen:
        let_go = [ais.Stream(DEV)]
        close_with_a_failed_release(own_backend, caplog, "cuCtxPushCurrent", let_go)
    assert succeeded(seen["cuStreamCreateWithPriority"]) == 1, seen
    assert unreleased(seen) == {}, seen
    if FAKE is not None:
        assert FAKE.fake_cuda_live(0) == streams


@pytest.mark.parametrize(
    "call",
    [
        "cuMemFreeHost",  # a host buffer used by no stream: freed at once
        "cuMemFreeAsync",  # a buffer used on its allocation stream only: freed there
        "cuStreamCreateWithPriority",  # the device's free stream, made on its first use
        "cuStreamWaitEvent",  # the free stream waiting for the buffer's streams
        "cuModuleUnload",  # the sleep kernel's module, at close
    ],
)
def test_a_failed_free_is_said_once_at_close_and_loses_nothing_else(
    own_backend: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """The frees of memory dropped by the program, and the module unloaded at close: one that
    fails is said once at close with its call, device and code, as every failed release is
    (a buffer used on two streams is freed on the device's own free stream, after both)."""
    from cuda.bindings import driver

    modules: list[Any] = []  # the sleep kernel's module, as the driver gives it to the backend
    load = driver.cuModuleLoadData

    def loaded(image: Any) -> Any:
        result = load(image)
        modules.append(result[1])
        return result

    monkeypatch.setattr(driver, "cuModuleLoadData", loaded)
    s, other = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(0.001, stream=s)  # the sleep kernel is loaded (this backend's first delay)
    (module,) = modules
    host = ais.HostBuffer(N, device=DEV)
    with ais.use_stream(s):
        buf = ais.DeviceBuffer(N, DEV)
    if call in ("cuStreamCreateWithPriority", "cuStreamWaitEvent"):
        ais.copy_async(host, buf, stream=other)  # a second stream uses it
    s.synchronize_blocking()
    other.synchronize_blocking()
    address = host.numpy().ctypes.data if call == "cuMemFreeHost" else ptr(buf)
    let_go = [host, buf]
    kept = (host, buf) if call == "cuModuleUnload" else ()  # held at close
    del host, buf
    close_with_a_failed_release(own_backend, caplog, call, let_go)
    del kept
    with primary_context() as cu:  # what the failed call left, released as a user would
        if call == "cuModuleUnload":
            assert cu.cuModuleUnload(module) == (cu.CUresult.CUDA_SUCCESS,)
        elif call == "cuMemFreeHost":
            assert cu.cuMemFreeHost(address) == (cu.CUresult.CUDA_SUCCESS,)
        else:  # stream-ordered memory: freed on a stream
            freed = cu.cuMemFreeAsync(cu.CUdeviceptr(address), cu.CUstream(0))
            assert freed == (cu.CUresult.CUDA_SUCCESS,)
            assert cu.cuCtxSynchronize() == (cu.CUresult.CUDA_SUCCESS,)


# ---------------------------------------------- in programs of their own


FAULT_AT_EXIT = """
import gc, anyio, aiostream as ais
s = ais.Stream("cuda:0")
kept = [ais.HostBuffer(64, device="cuda:0"), ais.Event("cuda:0")]
with ais.use_stream(s):
    dev = ais.DeviceBuffer(64, "cuda:0")
dropped = [ais.Stream("cuda:0"), ais.HostBuffer(64, device="cuda:0")]
launch_trap(s)
try:
    s.synchronize_blocking()
except ais.CudaError as exc:
    print("failed", exc.name, flush=True)
del dev, s  # each release fails now: counted, never raised
dropped.clear()
gc.collect()
print("exiting", flush=True)
"""


def test_a_faulted_program_exits_without_tracebacks() -> None:
    """A kernel that traps (on a GPU as on the stand-in), objects dropped after it: the wait
    raises the fault, and the program exits without a traceback, at most one line saying what
    could not be released."""
    proc = program(TRAP + FAULT_AT_EXIT)
    assert "failed CUDA_ERROR_LAUNCH_FAILED" in proc.stdout and "exiting" in proc.stdout
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    lines = proc.stderr.strip().splitlines()  # at most one line: what could not be released
    assert len(lines) <= 1, proc.stderr
    assert not lines or "could not release" in lines[0]


AFTER_CLOSE = """
import atexit, anyio, numpy as np, aiostream as ais

views = []

def report():  # registered before aiostream's first use: it runs after the backend closed
    print("read", int(np.concatenate(views).sum()), flush=True)
    for use in (lambda: stream.query(), lambda: stream.__cuda_stream__(),
                lambda: ais.copy_async(host, dev, stream=stream), lambda: event.event_id,
                lambda: ais.HostBuffer(8, device="cuda:0"), lambda: ais.Stream("cuda:0")):
        try:
            use()
        except ais.AiostreamError as exc:
            print("refused:", exc, flush=True)

atexit.register(report)

async def main():
    global stream, host, dev, event, plain
    stream = ais.Stream("cuda:0")
    host = ais.HostBuffer(64, device="cuda:0")
    dev = ais.DeviceBuffer(64, "cuda:0")
    host.numpy()[:] = 3
    ais.copy_async(dev, host, stream=stream)
    event = stream.record_event()
    await event.synchronize()
    plain = ais.HostBuffer(64, device="cuda:0")  # used on no stream: a free would be at once
    plain.numpy()[:] = 1
    views.extend([host.numpy(), plain.numpy()])  # pinned memory, read after the close

anyio.run(main)
"""


def test_after_the_close_at_exit_views_still_read_and_every_use_says_why() -> None:
    """The backend closes at exit, before the atexit handlers registered earlier than its
    first use: they still read the host views of the buffers the program holds (left to the
    exit with their context, not freed under the views), and every use of a stream, event or
    buffer raises, naming the close, rather than calling the driver with a handle that names
    nothing (the stand-in counts that as a violation and fails the process)."""
    proc = program(AFTER_CLOSE)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "read 256", proc.stdout  # 64 bytes of 3, 64 of 1
    assert lines[1:] == [f"refused: {CLOSED}"] * 6, proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


CANCELLED_AT_EXIT = """
import sys, time, anyio, aiostream as ais

loop, strategy, kernel_s = sys.argv[1], sys.argv[2], float(sys.argv[3])

async def main():
    s = ais.Stream("cuda:0")
    ais.delay(kernel_s, stream=s)
    with anyio.move_on_after(0.05):
        await s.synchronize(strategy=strategy)
    time.sleep(0.05)  # a thread is blocked on the kernel now
    print("leaving", flush=True)

anyio.run(main, backend=loop)
"""


@pytest.mark.parametrize(
    ("loop", "strategy"),
    [("asyncio", "thread"), ("asyncio", "hybrid"), ("trio", "thread"), ("asyncio", "callback")],
)
def test_exit_is_never_held_by_device_work(loop: str, strategy: str) -> None:
    """A wait cancelled while a long kernel runs: the interpreter exits at once; the context,
    busy with the kernel, is left to the exit (the stand-in allows its live handles then)."""
    kernel_s = "60" if FAKE is None else "6"
    start = time.monotonic()
    proc = program(CANCELLED_AT_EXIT, loop, strategy, kernel_s, timeout=30)
    took = time.monotonic() - start
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert took < 5.0, f"exit took {took:.1f} s"
    assert "violation" not in proc.stderr, proc.stderr


EXTERNAL_AT_EXIT = """
import sys, aiostream as ais
from cuda.bindings import driver as d

d.cuInit(0)
err, dev = d.cuDeviceGet(0)
err, ctx = d.cuDevicePrimaryCtxRetain(dev)
d.cuCtxSetCurrent(ctx)
err, raw = d.cuStreamCreate(1)  # the program's own stream, which aiostream does not own
ais.delay(float(sys.argv[1]), stream=ais.ExternalStream(int(raw), "cuda:0"))
print("leaving", flush=True)
"""


def test_exit_is_never_held_by_a_delay_on_a_stream_made_elsewhere() -> None:
    """The sleep kernel on a stream aiostream did not make (and so cannot query at close):
    close still sees it pending and leaves its module to the exit (unloading it waits for
    the kernel: the stand-in calls that a violation)."""
    kernel_s = "60" if FAKE is None else "6"
    start = time.monotonic()
    proc = program(EXTERNAL_AT_EXIT, kernel_s, timeout=30)
    took = time.monotonic() - start
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert took < 5.0, f"exit took {took:.1f} s"
    assert "violation" not in proc.stderr, proc.stderr


CLOSED_LOOP_AT_EXIT = """
import asyncio, sys, time, aiostream as ais

kind, strategy = sys.argv[1], sys.argv[2]
if kind == "uvloop":
    import uvloop
    loop = uvloop.new_event_loop()
else:
    loop = asyncio.new_event_loop()
short, hung = ais.Stream("cuda:0"), ais.Stream("cuda:0")
ais.delay(0.2, stream=short)
ais.delay(30, stream=hung)
tasks = [loop.create_task(s.synchronize(strategy=strategy)) for s in (short, hung)]
loop.run_until_complete(asyncio.sleep(0.1))
loop.close()
time.sleep(0.3)  # the short kernel ends: its wait's loop is gone
print("pending", len(ais.pending_waits()), flush=True)
"""


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_program_that_closed_its_loop_with_waits_pending_exits(kind: str, strategy: str) -> None:
    """A program closes its event loop while its tasks wait on CUDA work, then ends: the
    waits are forgotten, and the interpreter exits at once (the coroutines' clean-up, run
    by the collector as it finalizes, never waits for a lock the frozen watcher thread may
    hold), with no traceback of aiostream's."""
    if kind == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is not installed")
    start = time.monotonic()
    proc = program(CLOSED_LOOP_AT_EXIT, kind, strategy, timeout=30)
    took = time.monotonic() - start
    assert proc.returncode == 0 and "pending 0" in proc.stdout, proc.stderr
    assert took < 10.0, f"exit took {took:.1f} s"
    assert "Traceback" not in proc.stderr and "violation" not in proc.stderr, proc.stderr


DROPPED_AT_EXIT = """
import gc, anyio, aiostream as ais

async def main():
    s = ais.Stream("cuda:0")
    ais.delay(2.0, stream=s)
    e = s.record_event()  # its mark: a value the device will write into pinned memory
    with anyio.move_on_after(0.02):
        await e.synchronize()
    del s, e  # the stream is destroyed with its work pending
    gc.collect()
    print("leaving", flush=True)

anyio.run(main)
"""


def test_exit_frees_no_flag_memory_that_a_dropped_streams_work_will_write() -> None:
    """At exit, flag memory that pending work will still write is left to the process's
    exit, also when the stream that work runs on is gone (it can no longer be queried)."""
    proc = program(DROPPED_AT_EXIT)
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert "violation" not in proc.stderr, proc.stderr


DROPPED_BUSY_AT_EXIT = """
import gc, logging, aiostream as ais
logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")
s = ais.Stream("cuda:0")
ais.delay(2.0, stream=s)
del s  # destroyed: the driver lets its work run on
gc.collect()
print("leaving", flush=True)
"""


def test_exit_sees_work_pending_on_a_stream_already_destroyed() -> None:
    """A stream dropped with work pending is destroyed at once; at exit its context is still
    seen busy and left to the exit, not reset under that work (which could wait for it): the
    debug log says so on any driver, and the stand-in's exit report (either build) that no
    context was reset under pending work."""
    proc = program(DROPPED_BUSY_AT_EXIT, FAKE_CUDA_TRACE="1")
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert "reset with work pending" not in proc.stderr, proc.stderr
    if on_the_stand_in():
        assert "at exit: 0 violation(s), 0 handle(s) leaked at a context reset, 0 live" in (
            proc.stderr
        ), proc.stderr
    assert (
        "aiostream: cuda:0: work that may use its context is pending at close: the context is "
        "left to the exit\n"
    ) in proc.stderr, proc.stderr


USED_ELSEWHERE_AT_EXIT = """
import gc, logging, sys, anyio, aiostream as ais
logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")

async def main():
    up = ais.HostBuffer(1 << 16, device="cuda:0")
    s1 = ais.Stream("cuda:1")
    with ais.use_stream(s1):
        dev = ais.DeviceBuffer(1 << 16, "cuda:1")
    if sys.argv[1] == "copy-pending":
        ais.delay(2.0, stream=s1)
        ais.copy_async(dev, up, stream=s1)  # reads cuda:0's pinned memory in 2 s
    else:  # the copy is over, but the work after it, which the free waits for, is not
        ais.copy_async(dev, up, stream=s1)
        await s1.synchronize()
        ais.delay(2.0, stream=s1)
    del up, dev, s1
    gc.collect()
    print("leaving", flush=True)

anyio.run(main)
"""


@pytest.mark.parametrize("case", ["copy-pending", "later-work-pending"])
def test_exit_keeps_a_context_whose_memory_another_devices_pending_work_uses(case: str) -> None:
    """Pinned memory of cuda:0 that a copy on cuda:1 reads, dropped while cuda:1 has work
    pending (the copy, or work after it that the free must wait for): at exit cuda:0's
    context, idle itself, is left to the exit with that memory, not released (which would
    free it under the copy), as the debug log says; on the stand-in (given two devices,
    either build), nothing is reset under pending work, nothing leaks."""
    stand_in = on_the_stand_in()
    if not stand_in:
        two_devices()
    # the stand-in's settings: a GPU's driver reads neither
    proc = program(USED_ELSEWHERE_AT_EXIT, case, FAKE_CUDA_DEVICES="2", FAKE_CUDA_TRACE="1")
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    if stand_in:
        assert "at exit: 0 violation(s), 0 handle(s) leaked at a context reset, 0 live" in (
            proc.stderr
        ), proc.stderr
        assert "cuda:0 reset" not in proc.stderr, proc.stderr
    assert (
        "aiostream: cuda:0: 1 buffer(s) may still be in use by another device's pending work "
        "at close: they are left to the exit, with the context\n"
    ) in proc.stderr, proc.stderr


HELD_ELSEWHERE = """
import anyio, aiostream as ais
from cuda.bindings import driver as d
s = ais.Stream("cuda:0")
err, ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])  # another library holds it
assert int(err) == 0

async def main():
    ais.delay(0.2, stream=s)
    with anyio.move_on_after(0.02):
        await s.synchronize(strategy="callback")
    print("leaving", flush=True)

anyio.run(main)
"""


def test_host_functions_pending_at_exit_run_no_python() -> None:
    """With the context held by another library, aiostream's release does not reset it: a
    host function still pending then runs after the interpreter has finalized. It is a C
    function, so that is harmless."""
    proc = program(HELD_ELSEWHERE)
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
    assert "violation" not in proc.stderr, proc.stderr


def test_the_watcher_thread_never_holds_the_exit() -> None:
    """The watcher is a daemon thread: the interpreter's exit never joins it. (The kernel
    outlasts the wait's start however busy the machine, so the wait is watched.)"""
    s = ais.Stream(DEV)
    ais.delay(0.5, stream=s)
    s.synchronize_blocking()
    watchers = [t for t in threading.enumerate() if t.name == f"aiostream {DEV} watcher"]
    assert watchers and all(t.daemon for t in watchers), watchers
