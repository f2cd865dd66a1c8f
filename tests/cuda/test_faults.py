"""The CUDA backend checks every driver result: a call that fails raises a CudaError naming
the call, the device and the code, where it was made (the public calls, the backend's own
calls as it opens a device, loads its kernel or makes its completion flags, the waits' host
functions and queries), and leaves the device usable; a driver without ``cuLaunchHostFunc``
has every wait polled.

Faults are injected where aiostream calls the driver, at cuda-python's bindings
(``tests/helpers/faults.py``): the tests run on any driver, a GPU included. The stand-in's
counts of live handles (``tests/helpers/stand_in.py``) are checked besides where it is the
driver.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import (
    DEV,
    TRAP,
    N,
    a_failed_call_is_raised_where_it_was_made,
    live,
    new_backend,
    program,
)
from tests.helpers.faults import calls, failing, succeeded
from tests.helpers.process import run_python
from tests.helpers.protocol import ANNOUNCED, STRATEGIES, backend_of, handle_of
from tests.helpers.stand_in import FAKE, MODULES

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# -------------------------------------------------- every result checked


def as_if_from_another_process(buf: ais.DeviceBuffer) -> bytes:
    """``buf``'s IPC handle as if another process had made it: its memory's part (what the
    backend's ``memory_ipc_handle`` gives, which starts with the exporter's pid) names another
    process."""
    handle = buf.ipc_handle()
    memory = backend_of(buf).memory_ipc_handle(handle_of(buf))
    assert handle.count(memory) == 1, "the buffer's handle holds its memory's part"
    at = handle.index(memory)
    return handle[:at] + (os.getpid() + 1).to_bytes(4, "little") + handle[at + 4 :]


def _submissions() -> dict[str, Callable[[dict[str, Any]], object]]:
    """Public calls, each making the driver call its name starts with (first, if more)."""

    def marked_alloc(o: dict[str, Any]) -> object:
        with ais.use_stream(o["s"]):  # recorded after the allocation: its marker
            return ais.DeviceBuffer(N, DEV)

    def busy_wait(o: dict[str, Any]) -> object:
        ais.delay(0.01, stream=o["s"])
        return o["s"].synchronize_blocking()

    def timing(o: dict[str, Any]) -> object:
        o["t0"].record(o["s"])
        o["t1"].record(o["s"])
        o["t1"].synchronize_blocking()
        return o["t0"].elapsed_time(o["t1"])

    def opened(o: dict[str, Any]) -> object:
        fresh = new_backend()  # opens its devices on first use
        try:
            return fresh.priority_range(0)
        finally:
            fresh.close()

    def used_elsewhere_early(o: dict[str, Any]) -> object:
        ais.delay(0.05, stream=o["s"])
        with ais.use_stream(o["s"]):  # its allocation is ordered after the kernel
            buf = ais.DeviceBuffer(N, DEV)
        other = ais.Stream(DEV)  # waits for the allocation's marker before it uses the buffer
        return ais.copy_async(o["h"], buf, stream=other)

    def consumer_ordered(o: dict[str, Any]) -> object:
        consumer = ais.Stream(DEV)  # ordered after the buffer's users, on the device
        return o["d"].__dlpack__(stream=consumer.stream_id, max_version=(1, 0))

    def shared_opened(o: dict[str, Any]) -> object:
        return ais.DeviceBuffer.from_ipc_handle(DEV, as_if_from_another_process(o["shared"]))

    from aiostream.__main__ import info

    return {
        "cuStreamCreateWithPriority": lambda o: ais.Stream(DEV, priority=-1),
        "cuEventCreate": lambda o: ais.Event(DEV).record(o["s"]),
        "cuEventRecord": lambda o: o["e"].record(o["s"]),
        "cuEventRecord (the marker of a stream-ordered allocation)": marked_alloc,
        "cuEventQuery": lambda o: o["e"].query(),
        "cuStreamQuery": lambda o: o["s"].query(),
        "cuStreamWaitEvent": lambda o: o["s"].wait_event(o["e"]),
        "cuLaunchKernel": lambda o: ais.delay(0.001, stream=o["s"]),
        "cuMemHostAlloc": lambda o: ais.HostBuffer(N, device=DEV),
        "cuMemAllocAsync": lambda o: ais.DeviceBuffer(N, DEV),
        "cuMemAlloc (a buffer to share)": lambda o: ais.DeviceBuffer(N, DEV, interprocess=True),
        "cuStreamWaitEvent (a buffer used on another stream before its allocation completed)": (
            used_elsewhere_early
        ),
        "cuStreamWaitEvent (a DLPack consumer's stream)": consumer_ordered,
        "cuIpcOpenEventHandle (opening a shared buffer)": shared_opened,
        "cuMemcpyHtoDAsync": lambda o: ais.copy_async(o["d"], o["h"], stream=o["s"]),
        "cuMemcpyDtoHAsync": lambda o: ais.copy_async(o["h"], o["d"], stream=o["s"]),
        "cuMemcpyDtoDAsync": lambda o: ais.copy_async(o["d2"], o["d"], stream=o["s"]),
        "cuStreamWriteValue32 (a stream's capture)": busy_wait,
        "cuEventElapsedTime": timing,
        "cuStreamGetPriority": lambda o: ais.ExternalStream(o["s"].stream_id, DEV),
        "cuIpcGetEventHandle": lambda o: o["ipc"].ipc_handle(),
        "cuCtxPushCurrent": lambda o: o["s"].query(),
        "cuDeviceGetName (python -m aiostream info)": lambda o: info(),
        "cuDeviceGet (python -m aiostream info)": lambda o: info(),
        "cuDeviceGet (a backend opening its device)": opened,
        "cuIpcGetMemHandle": lambda o: ais.DeviceBuffer(N, DEV, interprocess=True).ipc_handle(),
    }


@pytest.mark.parametrize("what", list(_submissions()))
def test_every_driver_result_is_checked(what: str) -> None:
    """A driver call that fails raises a CudaError naming the call and its code, where the call
    was made, and leaves the device usable (the failure was not a sticky one). (The case of a
    device that writes no values is in ``tests/internals/cuda/test_markers.py``.)"""
    a_failed_call_is_raised_where_it_was_made(what, _submissions()[what])


def _nothing(device: str) -> None:
    return None


def _delay(s: ais.Stream) -> ais.Stream:
    """A kernel on ``s`` (the sleep kernel is loaded on its first use)."""
    ais.delay(0.001, stream=s)
    return s


def _delayed(device: str) -> ais.Stream:
    """A stream busy for long enough that a wait for it must mark its work."""
    s = ais.Stream(device)
    ais.delay(0.2, stream=s)
    return s


def _waited(s: ais.Stream) -> None:
    """``s``'s work waited for: the wait's mark takes a completion flag."""
    s.synchronize_blocking()


@pytest.mark.parametrize(
    ("call", "ready", "make"),
    [
        ("cuDevicePrimaryCtxRetain", _nothing, lambda _: ais.Stream(DEV)),  # the first use
        ("cuCtxGetStreamPriorityRange", _nothing, lambda _: ais.Stream(DEV)),
        ("cuEventCreate", _nothing, lambda _: ais.DeviceBuffer(N, DEV)),  # the first marker
        ("cuModuleLoadData", ais.Stream, _delay),  # the sleep kernel, on first use
        ("cuModuleGetFunction", ais.Stream, _delay),
        ("cuMemHostAlloc", _delayed, _waited),  # the first completion flag: its pinned memory
        ("cuMemHostGetDevicePointer", _delayed, _waited),
    ],
    ids=[
        "retaining the context",
        "opening the device",
        "a marker",
        "loading the sleep kernel",
        "finding the sleep kernel",
        "the completion flags' memory",
        "the completion flags' device address",
    ],
)
def test_driver_calls_of_the_backend_s_own_are_checked(
    own_backend: Any, call: str, ready: Callable[[str], Any], make: Callable[[Any], object]
) -> None:
    """Calls the backend makes for itself (opening a device, the first marker of its pool, its
    sleep kernel, its completion flags) raise a CudaError naming the call and the device when
    they fail, leave nothing behind, and the next try works."""
    prepared = ready(DEV)
    before = live() if FAKE is not None else []
    with calls("cuModuleLoadData") as seen:
        with failing(call), pytest.raises(ais.CudaError) as info:
            make(prepared)
        assert str(info.value).startswith(f"{call} failed on {DEV}: CUDA_ERROR_UNKNOWN (999)")
        kept = call == "cuModuleGetFunction"  # the module loaded is kept: the next try uses it
        if FAKE is not None:
            assert live() == [n + (kept and kind == MODULES) for kind, n in enumerate(before)]
        made = make(prepared)
    loaded = call.startswith("cuModule")
    assert succeeded(seen["cuModuleLoadData"]) == loaded  # once, however many tries
    ais.current_stream(DEV).synchronize_blocking()
    del made
    gc.collect()


CANNOT_OPEN_CHILD = """
import sys
import aiostream as ais
from tests.helpers.cuda import live
from tests.helpers.faults import calls, failing
from tests.helpers.stand_in import FAKE

code = int(sys.argv[2])
ais.Stream("cuda:0")
before = live() if FAKE is not None else None
with calls("cuIpcOpenEventHandle", "cuEventDestroy") as seen:
    try:
        with failing("cuIpcOpenMemHandle", 1, code):
            ais.DeviceBuffer.from_ipc_handle("cuda:0", bytes.fromhex(sys.argv[1]))
    except (ValueError, ais.CudaError) as exc:
        driver = exc.__cause__ if code == 1 else exc
        print(type(exc).__name__, type(driver).__name__, flush=True)
        print(exc, flush=True)
        print(driver, flush=True)
(opened,) = [int(result[1]) for _, result in seen["cuIpcOpenEventHandle"] if int(result[0]) == 0]
closed = [int(args[0]) for args, _ in seen["cuEventDestroy"]] == [opened]
print(closed and (FAKE is None or live() == before), flush=True)
"""


@pytest.mark.parametrize("code", [1, 999])
def test_a_shared_buffer_the_driver_cannot_open_says_so(code: int) -> None:
    """``cuIpcOpenMemHandle`` refusing a handle in another process: CUDA_ERROR_INVALID_VALUE
    (a handle from no live export) says what to pass, with the driver's error as its cause;
    any other code is the driver's error itself. Nothing opened is left open."""
    buf = ais.DeviceBuffer(N, DEV, interprocess=True)
    child = run_python("-c", CANNOT_OPEN_CHILD, buf.ipc_handle().hex(), str(code))
    assert child.returncode == 0, child.stderr[-3000:]
    kinds, said, driver, closed = child.stdout.splitlines()
    name = "CUDA_ERROR_INVALID_VALUE" if code == 1 else "CUDA_ERROR_UNKNOWN"
    assert kinds == ("ValueError CudaError" if code == 1 else "CudaError CudaError")
    assert driver.startswith(f"cuIpcOpenMemHandle failed on {DEV}: {name} ({code})")
    if code == 1:
        assert said == (
            "the driver cannot open this memory IPC handle (CUDA_ERROR_INVALID_VALUE): pass the "
            "bytes that DeviceBuffer.ipc_handle() returned in another process, while the "
            "exported buffer is alive"
        )
    assert closed == "True"  # the exporter's event, opened first, is closed again
    assert "fake_cuda: at exit" not in child.stderr, child.stderr
    del buf


# ----------------------------------------------------------------- waits


async def a_wait_failing_once(make: Callable[[], ais.Stream], strategy: str, call: str) -> None:
    """Await the stream ``make`` gives (made with the fault in place: a device opened then
    launches its host functions through it) with the driver's next ``call`` failing: the wait
    raises that error, with the call, device and code; the next wait gets the driver's own
    answers and ends with the work."""
    with failing(call):
        s = make()
        with anyio.fail_after(5), pytest.raises(ais.CudaError) as info:
            await s.synchronize(strategy=strategy)
    assert str(info.value) == f"{call} failed on cuda:0: CUDA_ERROR_UNKNOWN (999): unknown error"
    with anyio.fail_after(5):
        await s.synchronize(strategy=strategy)
    assert s.query()


@pytest.mark.parametrize("strategy", ["hybrid", "poll"])  # the strategies that query
async def test_a_failed_query_of_a_marker_event_is_raised_with_its_call(
    anyio_backend: object, own_backend: Any, strategy: str
) -> None:
    """Where marks are internal events, a wait asks the driver whether its marker completed:
    an error the driver returns then ends the wait with that error, naming the call."""
    with failing("cuStreamWriteValue32", 1, 801):  # NOT_SUPPORTED: no value writes here
        s = ais.Stream(DEV)
        ais.delay(0.05, stream=s)
        await a_wait_failing_once(lambda: s, strategy, "cuEventQuery")  # the first: the marker's


@pytest.mark.parametrize("strategy", sorted(ANNOUNCED))
async def test_a_wait_whose_host_function_cannot_be_launched_is_polled(
    anyio_backend: object, own_backend: Any, caplog: pytest.LogCaptureFixture, strategy: str
) -> None:
    """A wait handed to the watcher launches a host function to announce its work; if the
    driver refuses it, the wait is polled instead (a failed device is told by the health
    check) and still ends with its work."""
    with failing("cuLaunchHostFunc") as fault:
        s = ais.Stream(DEV)  # the device opens: its watcher launches through the fault
        ais.delay(0.02, stream=s)
        assert not fault.made  # the wait below launches the first
        with anyio.fail_after(5), caplog.at_level("DEBUG", logger="aiostream"):
            await s.synchronize(strategy=strategy)
        assert s.query() and fault.failed
    assert "cuda:0: no host function for a wait" in caplog.messages


@pytest.mark.parametrize("strategy", sorted(ANNOUNCED))
async def test_a_failed_host_function_on_a_handed_out_stream_is_raised(
    anyio_backend: object, own_backend: Any, strategy: str
) -> None:
    """On a stream handed out (others may submit to it unseen), a wait's host function is
    launched when the wait begins; if the driver refuses it, the wait raises the driver's
    error with its call, and the next wait is the driver's own again."""

    def handed_out() -> ais.Stream:
        s = ais.Stream(DEV)  # the device opens: its watcher launches through the fault
        s.__cuda_stream__()
        ais.delay(0.02, stream=s)
        return s

    await a_wait_failing_once(handed_out, strategy, "cuLaunchHostFunc")


async def test_a_wait_that_cannot_make_the_health_event_raises_the_driver_s_error(
    anyio_backend: object, own_backend: Any
) -> None:
    """A device's health is asked of an event of the watcher's, made on the first check: if
    the driver cannot make it, the wait that checks raises that error with its call (kept as
    the check's answer for a millisecond, as a query's is), and the next check after that
    makes it."""
    s = ais.Stream(DEV)
    ais.delay(0.05, stream=s)
    assert own_backend.held(0)["events"] == 0  # no event of its own yet
    with failing("cuEventCreate"), anyio.fail_after(5), pytest.raises(ais.CudaError) as info:
        await s.synchronize(strategy="poll")
    expected = "cuEventCreate failed on cuda:0: CUDA_ERROR_UNKNOWN (999): unknown error"
    assert str(info.value) == expected
    assert own_backend.held(0)["events"] == 0
    await anyio.sleep(0.002)  # past the millisecond the failed check's answer is kept
    with anyio.fail_after(5):
        await s.synchronize(strategy="poll")
    assert own_backend.held(0)["events"] == 1 and s.query()  # the health event, made now


TRAP_TOLD = """
import faulthandler, time
import aiostream as ais
from aiostream._backends.cuda.watcher import Watcher

faulthandler.dump_traceback_later(20, exit=True)  # a hang: every thread's stack, exit 1
s = ais.Stream("cuda:0")
word = launch_trap(s, held=True)
watch, looks = Watcher.watch, []

def watched(self, target, callback, gone):
    looks.append(target)
    if len(looks) == 1:  # the trap runs after the wait's mark, before the watcher's first look
        release(word)
    watch(self, target, callback, gone)

Watcher.watch = watched
start = time.monotonic()
try:
    s.synchronize_blocking()
    print("completed", flush=True)
except ais.CudaError as exc:
    print("told", exc.name, len(looks), f"{time.monotonic() - start:.3f}", flush=True)
"""


def test_a_wait_on_a_stream_whose_kernel_trapped_is_told_once() -> None:
    """A kernel of another library's traps on an aiostream stream (a real fault: sticky, every
    later call fails, the mark after it never lands), seen by no call of aiostream's before
    the wait's mark is on the stream: the watcher's first health check, where the device's
    health event is still to be made, meets the fault in that event's creation, and keeps it
    as its answer. The wait it tells raises it, at once: watched once, never told again and
    again (the check the wait makes within the millisecond once found the device fine)."""
    proc = program(TRAP + TRAP_TOLD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    told = proc.stdout.split()
    assert told[:3] == ["told", "CUDA_ERROR_LAUNCH_FAILED", "1"], proc.stdout
    assert float(told[3]) < 5, proc.stdout


@pytest.mark.parametrize("lookup", ["not found", "no cuGetProcAddress"])
async def test_a_driver_without_cuLaunchHostFunc_has_every_wait_polled(
    anyio_backend: object, own_backend: Any, monkeypatch: pytest.MonkeyPatch, lookup: str
) -> None:
    """Where the driver has no ``cuLaunchHostFunc`` to give (or no ``cuGetProcAddress`` to
    ask), no wait is announced by a host function (nor by the bindings' own
    ``cuLaunchHostFunc``, whose wrapper takes the GIL on the driver's thread): a wait of every
    strategy is polled by the watcher or the loop, and ends with its work."""
    from cuda.bindings import driver

    def refuse(symbol: bytes, version: int, flags: int) -> Any:
        if lookup == "not found":
            return driver.CUresult.CUDA_ERROR_NOT_FOUND, 0, None
        raise RuntimeError("Function cuGetProcAddress not found")

    monkeypatch.setattr(driver, "cuGetProcAddress", refuse)
    with calls("cuLaunchHostFunc") as seen:
        s = ais.Stream(DEV)  # the device's first use by this backend: its watcher looks it up
        host_calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
        for strategy in STRATEGIES:
            ais.delay(0.005, stream=s)
            with anyio.fail_after(5):
                await s.synchronize(strategy=strategy)
            assert s.query(), strategy
    assert seen["cuLaunchHostFunc"] == []
    if FAKE is not None:  # and the driver ran none
        assert FAKE.fake_cuda_host_calls() == host_calls
