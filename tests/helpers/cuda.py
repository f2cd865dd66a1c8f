"""What the CUDA tests share: the device's primary context as a user's own driver calls reach
it, the driver's allocations as the bindings see them, the stand-in's counts of live handles,
programs of their own, a CUDA backend of a test's own, and the check that a failing driver call
is raised where it was made.

The tests reach aiostream through public names and ``tests/helpers/protocol.py``; a backend of
a test's own (``own_backend``) is made and installed here, through the registry of backends,
as the process's exit closes the shared one. ``tests/cuda/conftest.py`` and
``tests/internals/cuda/conftest.py`` turn it into a fixture.
"""

from __future__ import annotations

import contextlib
import gc
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import aiostream as ais
from aiostream import _backends
from aiostream._backends.base import AnyBackend
from tests.helpers.process import run_python
from tests.helpers.protocol import backend
from tests.helpers.stand_in import FAKE, hurry

DEV = "cuda:0"
N = 4096

#: what every use of a stream, event or buffer says once the backend closed at exit
CLOSED = (
    "the CUDA backend was closed (the interpreter is exiting): its streams, events and "
    "buffers can no longer be used; finish GPU work before the exit (an atexit handler "
    "registered before aiostream's first use runs after it closed)"
)


def two_devices() -> None:
    """Skip the test where there are fewer than two CUDA devices."""
    if ais.device_count("cuda") < 2:
        pytest.skip("needs two CUDA devices")


def ptr(buf: ais.DeviceBuffer) -> int:
    """A device buffer's address, as other libraries read it."""
    return int(buf.__cuda_array_interface__["data"][0])


def held(index: int = 0) -> dict[str, int]:
    """What the shared CUDA backend holds for its own use on device ``index`` (its
    ``held()``: internal streams and events, waits watched, flag slots and chunks)."""
    return backend("cuda").held(index)  # type: ignore[attr-defined, no-any-return]


def current_context() -> int:
    """The calling thread's current CUDA context, as the driver says (0: none)."""
    from cuda.bindings import driver

    err, ctx = driver.cuCtxGetCurrent()
    assert int(err) == 0
    return int(ctx)


@contextlib.contextmanager
def primary_context(index: int = 0) -> Iterator[Any]:
    """Device ``index``'s primary context, retained and made current for the block (a user's
    own driver calls); the bindings' module is what the block gets."""
    from cuda.bindings import driver as cu

    device = cu.cuDeviceGet(index)[1]
    ctx = cu.cuDevicePrimaryCtxRetain(device)[1]
    assert cu.cuCtxPushCurrent(ctx) == (cu.CUresult.CUDA_SUCCESS,)
    try:
        yield cu
    finally:
        cu.cuCtxPopCurrent()
        cu.cuDevicePrimaryCtxRelease(device)


def device_finishes(index: int = 0) -> None:
    """Wait until device ``index`` has finished all its work, as a program's last synchronize
    does."""
    with primary_context(index) as cu:
        assert cu.cuCtxSynchronize() == (cu.CUresult.CUDA_SUCCESS,)


def live() -> list[int]:
    """The stand-in's count of each kind of live handle (streams, events, contexts, ...)."""
    return [FAKE.fake_cuda_live(kind) for kind in range(6)]


def context_refs() -> list[int]:
    """The stand-in's count of references to the primary contexts of cuda:0 and cuda:1."""
    return [FAKE.fake_cuda_context_refs(index) for index in (0, 1)]


@contextlib.contextmanager
def allocations() -> Iterator[dict[str, list[tuple[int, int]]]]:
    """The device memory the driver is asked for while the block runs, by the call asked
    (``cuMemAllocAsync``: stream-ordered memory of the device's pool; ``cuMemAlloc``): each
    call's result code and the address it gave (0 where it failed), seen through the
    bindings, which the backend calls."""
    from cuda.bindings import driver

    def spying(real: Any, seen: list[tuple[int, int]]) -> Any:
        def spy(*args: Any) -> Any:
            result = real(*args)
            code = int(result[0])
            seen.append((code, int(result[1]) if code == 0 else 0))
            return result

        return spy

    calls: dict[str, list[tuple[int, int]]] = {"cuMemAllocAsync": [], "cuMemAlloc": []}
    with pytest.MonkeyPatch.context() as patch:
        for name, seen in calls.items():
            patch.setattr(driver, name, spying(getattr(driver, name), seen))
        yield calls


def program(code: str, *args: str, timeout: float = 60, **env: str) -> Any:
    """Run ``code`` (with ``args`` in ``sys.argv[1:]``) in a new interpreter with this
    process's driver; the stand-in's exit report (violations, leaks) ends up in stderr and the
    exit status."""
    return run_python("-c", textwrap.dedent(code), *args, timeout=timeout, **env)


#: a program's part (before its own code) with a kernel that executes ``trap;``, launched on
#: an aiostream stream through the driver API, as another library's kernel is: it fails on
#: the device (``CUDA_ERROR_LAUNCH_FAILED``, sticky: every later call of the context returns
#: it), on a GPU as on the stand-in, which runs it as a GPU does. ``launch_trap(s)`` launches it
#: on ``s``; ``launch_trap(s, held=True)`` behind a stream memory wait for a word of pinned
#: memory, which it returns: ``release(word)`` lets the trap run and returns once the fault is
#: seen (``cuCtxSynchronize`` says so).
TRAP = r"""
import ctypes
from cuda.bindings import driver as cu

PTX = b'''
.version 7.0
.target sm_50
.address_size 64
.visible .entry aiostream_trap() { trap; }
''' + b"\0"

def _context():
    return cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1]

def launch_trap(stream, held=False):
    cu.cuCtxPushCurrent(_context())
    word = None
    handle = cu.CUstream(stream.__cuda_stream__()[1])
    # loaded before the gate: on a GPU, loading a module waits for the device's work
    err, module = cu.cuModuleLoadData(PTX)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, fn = cu.cuModuleGetFunction(module, b"aiostream_trap")
    assert err == cu.CUresult.CUDA_SUCCESS, err
    if held:
        err, word = cu.cuMemHostAlloc(4, 0x1 | 0x2)  # PORTABLE | DEVICEMAP
        assert err == cu.CUresult.CUDA_SUCCESS, err
        ctypes.c_uint32.from_address(int(word)).value = 0
        err, address = cu.cuMemHostGetDevicePointer(word, 0)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        waited = cu.cuStreamWaitValue32(handle, address, 1, 0)  # CU_STREAM_WAIT_VALUE_GEQ
        assert waited == (cu.CUresult.CUDA_SUCCESS,), waited
    launched = cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, handle, None, 0)
    assert launched == (cu.CUresult.CUDA_SUCCESS,), launched
    cu.cuCtxPopCurrent()
    return word

def release(word):
    ctypes.c_uint32.from_address(int(word)).value = 1
    cu.cuCtxPushCurrent(_context())
    (err,) = cu.cuCtxSynchronize()
    cu.cuCtxPopCurrent()
    assert err == cu.CUresult.CUDA_ERROR_LAUNCH_FAILED, err
"""


def new_backend() -> AnyBackend:
    """A new CUDA backend, not installed: it opens its devices on first use."""
    from aiostream._backends.cuda import CudaBackend

    return CudaBackend()


@contextlib.contextmanager
def own_backend() -> Iterator[Any]:
    """A CUDA backend of the block's own, installed for it (objects made meanwhile use it)
    and closed after it, as the process's exit closes the shared one."""
    from tests.helpers import gate

    ais.Stream(DEV)  # the shared backend holds the context: the block's close never resets it
    # what earlier tests dropped is released now, not during the block: their work is let go
    # (a gate left held; on the stand-in, a kernel that never ends) and is over, the gates'
    # words are freed, an allocation frees the memory that waited for it (and the streams
    # that waited for their memory), and a sweep gives back idle flag memory
    gate.release_all()
    if FAKE is not None:
        hurry()
    with primary_context() as cu:
        cu.cuCtxSynchronize()
    gate.sweep()
    gc.collect()
    ais.DeviceBuffer(1, DEV)
    held(0)
    mine = new_backend()
    old = _backends.replace("cuda", mine)
    try:
        yield mine
    finally:
        _backends.restore("cuda", old)
        # the block's work ends before the close (a block that means to close under work
        # closes inside): a close under work leaves its kernel's module to the exit, which a
        # context the shared backend keeps alive then holds as a live handle
        gate.release_all()
        with primary_context() as cu:
            cu.cuCtxSynchronize()
        gc.collect()
        mine.close()


def close_with_a_failed_release(
    closing: Any, caplog: pytest.LogCaptureFixture, call: str, let_go: list[Any], nth: int = 1
) -> tuple[Any, ...]:
    """Close ``closing`` (a backend) with the ``nth`` next ``call`` failing, once what
    ``let_go`` holds (the program's last references to some objects) is dropped and
    collected: close says the failed release once, with its call, device and code.

    What earlier tests left for the collector is collected first: a buffer of theirs freed
    by the collection below would take the failure meant for ``let_go``'s.

    The failure is injected at the bindings (``tests/helpers/faults.py``), on any driver,
    above whatever spy the test put in the entry point's place (which never sees the failed
    call); the failed call's arguments are returned (the handle it left)."""
    from tests.helpers.faults import failing

    gc.collect()
    with failing(call, nth) as fault:
        let_go.clear()
        gc.collect()
        # the markers the frees wait for complete first (memory still waiting at close is
        # left to the exit); this block's own driver calls are not aiostream's: they never
        # take a failure injected at the bindings
        device_finishes()
        with caplog.at_level("WARNING", logger="aiostream"):
            closing.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"aiostream could not release 1 CUDA handle(s) (the first: {call} failed on cuda:0: "
        "CUDA_ERROR_UNKNOWN (999): unknown error); the driver reclaims them with the context"
    ]
    assert fault.failed, f"close made no call {nth} of {call}"
    return fault.args


def a_failed_call_is_raised_where_it_was_made(
    what: str, submit: Callable[[dict[str, Any]], object]
) -> None:
    """``submit`` (a public call, given the objects below) with the driver's next call named
    by ``what``'s first word failing: it raises a CudaError naming the call and its code,
    where the call was made, and leaves the device usable (the failure was not a sticky
    one). The failure is injected at the bindings (``tests/helpers/faults.py``): it works on
    any driver."""
    from tests.helpers.faults import failing

    s = ais.Stream(DEV)
    with ais.use_stream(s):
        objects = {
            "s": s,
            "e": s.record_event(),
            "h": ais.HostBuffer(N, device=DEV),
            "d": ais.DeviceBuffer(N, DEV),
            "d2": ais.DeviceBuffer(N, DEV),
            "ipc": ais.Event(DEV, interprocess=True),
            "shared": ais.DeviceBuffer(N, DEV, interprocess=True),
            "t0": ais.Event(DEV, enable_timing=True),
            "t1": ais.Event(DEV, enable_timing=True),
        }
    objects["ipc"].record(s)
    objects["ipc_handle"] = objects["ipc"].ipc_handle()
    s.synchronize_blocking()
    gc.collect()  # no finalizer makes a driver call of its own meanwhile
    call = what.split(" ", 1)[0]
    with failing(call), pytest.raises(ais.CudaError) as info:
        submit(objects)
    assert info.value.code == 999 and info.value.name == "CUDA_ERROR_UNKNOWN", info.value
    assert f"{call} failed on {DEV}" in str(info.value)
    ais.delay(0.001, stream=s)  # and the device works on
    s.synchronize_blocking()
    assert s.query()


def host_function_launches(watcher: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The host functions a device's watcher launches from now on, each with its arguments
    (stream, function, data): it calls the driver's ``cuLaunchHostFunc`` through ctypes, where
    a spy on the bindings cannot see it; on any driver."""
    launched: list[tuple[int, ...]] = []
    launch = watcher.launch
    assert launch is not None, "no cuLaunchHostFunc here: the watcher polls"

    def spy(stream: int, fn: int, data: int) -> int:
        launched.append((stream, fn, data))
        return int(launch(stream, fn, data))

    monkeypatch.setattr(watcher, "launch", spy)
    return launched
