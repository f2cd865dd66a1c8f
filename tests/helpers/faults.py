"""Faults injected where aiostream meets the driver: cuda-python's bindings module.

The CUDA backend holds ``cuda.bindings.driver`` as a module and calls its entry points by
attribute (``cu.cuEventRecord(...)``), so replacing an attribute for a while changes what
aiostream's next calls get, on any driver, a GPU included:

- :func:`failing`: the ``nth`` next call of an entry point returns an error code (a
  ``CUresult``) instead of reaching the driver, shaped as the binding shapes a failure;
- :func:`calls`: the calls aiostream makes of some entry points, with their arguments and
  results, each still made (a spy); :func:`succeeded` counts those that worked.

Only the calls aiostream's own code makes count: the test's own driver calls (a context pushed
by ``tests/helpers/cuda.py``, a user's call) never take a failure meant for aiostream. The
backend's watcher thread makes calls too: the counts are kept under a lock.

What the bindings' layer cannot express stays with the stand-in's hooks
(``tests/helpers/stand_in.py``): a kernel that fails on the device, a context's sticky error,
a call the driver makes inside itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: how many values each entry point's binding returns after its ``CUresult`` (``None`` each
#: where the call failed): a failure injected is shaped the same, ``(CUresult(code),) +
#: (None,) * k``. Read off the bindings' docstrings ("Returns"); every real result that goes
#: through :func:`failing` is checked against it.
VALUES: dict[str, int] = {
    # contexts and devices
    "cuCtxGetStreamPriorityRange": 2,
    "cuCtxPopCurrent": 1,
    "cuCtxPushCurrent": 0,
    "cuCtxSetCurrent": 0,
    "cuCtxSynchronize": 0,
    "cuDeviceGet": 1,
    "cuDeviceGetAttribute": 1,
    "cuDeviceGetCount": 1,
    "cuDeviceGetName": 1,
    "cuDevicePrimaryCtxRelease": 0,
    "cuDevicePrimaryCtxRetain": 1,
    "cuThreadExchangeStreamCaptureMode": 1,
    # streams and events
    "cuEventCreate": 1,
    "cuEventDestroy": 0,
    "cuEventElapsedTime": 1,
    "cuEventQuery": 0,
    "cuEventRecord": 0,
    "cuEventSynchronize": 0,
    "cuStreamCreate": 1,
    "cuStreamCreateWithPriority": 1,
    "cuStreamDestroy": 0,
    "cuStreamGetPriority": 1,
    "cuStreamQuery": 0,
    "cuStreamSynchronize": 0,
    "cuStreamWaitEvent": 0,
    "cuStreamWriteValue32": 0,
    # kernels
    "cuLaunchKernel": 0,
    "cuModuleGetFunction": 1,
    "cuModuleLoadData": 1,
    "cuModuleUnload": 0,
    # memory
    "cuMemAlloc": 1,
    "cuMemAllocAsync": 1,
    "cuMemFree": 0,
    "cuMemFreeAsync": 0,
    "cuMemFreeHost": 0,
    "cuMemHostAlloc": 1,
    "cuMemHostGetDevicePointer": 1,
    "cuMemcpyDtoDAsync": 0,
    "cuMemcpyDtoHAsync": 0,
    "cuMemcpyHtoDAsync": 0,
    "cuMemGetAddressRange": 2,
    "cuPointerGetAttribute": 1,
    # sharing between processes
    "cuIpcCloseMemHandle": 0,
    "cuIpcGetEventHandle": 1,
    "cuIpcGetMemHandle": 1,
    "cuIpcOpenEventHandle": 1,
    "cuIpcOpenMemHandle": 1,
    # graphs and capture
    "cuGraphDebugDotPrint": 0,
    "cuGraphDestroy": 0,
    "cuGraphExecDestroy": 0,
    "cuGraphExecUpdate": 1,
    "cuGraphInstantiate": 1,
    "cuGraphLaunch": 0,
    "cuStreamBeginCapture": 0,
    "cuStreamEndCapture": 1,
    "cuStreamIsCapturing": 1,
}

#: the entry point aiostream calls through ctypes, at the address ``cuGetProcAddress`` gives
#: (``aiostream/_backends/cuda/watcher.py``): a failure of it is injected there
HOST_FUNC = "cuLaunchHostFunc"
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
#: the launchers handed out: a backend keeps calling one after the block that made it ended
_launchers: list[Any] = []


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _by_aiostream(depth: int = 2) -> bool:
    """Whether the call being made comes from aiostream's own code (the frame ``depth`` up)."""
    name = str(sys._getframe(depth).f_globals.get("__name__", ""))
    return name == "aiostream" or name.startswith("aiostream.")


class _Fault:
    """One entry point's failure: the calls counted (under a lock), the one that fails, and
    the real results' shapes seen."""

    def __init__(self, call: str, nth: int, code: int) -> None:
        self.call, self.nth, self.code = call, nth, code
        self.lock = threading.Lock()
        self.made = 0
        self.failed = False
        self.args: tuple[Any, ...] = ()  # the failed call's
        self.shapes: set[int] = set()

    def takes(self, args: tuple[Any, ...]) -> bool:
        """Whether the call now made, with ``args``, is the one that fails (counting it)."""
        with self.lock:
            self.made += 1
            if self.made == self.nth:
                self.failed, self.args = True, args
                return True
            return False


@contextlib.contextmanager
def failing(call: str, nth: int = 1, code: int = 999) -> Iterator[_Fault]:
    """For the block, the ``nth`` next call aiostream makes of the driver entry point ``call``
    (from any thread) returns ``code`` instead of calling the driver; the calls before and after
    it reach the driver. Blocks nest (each counts on its own). The block gets the fault: its
    ``failed`` says whether the call was made, its ``args`` with what.

    The failure sits above whatever the test put in the entry point's place before the block
    (a spy of its own): that never sees the failed call.

    ``cuLaunchHostFunc`` (called through ctypes) fails only on devices a backend opens during
    the block: their watcher asks ``cuGetProcAddress`` for it then, and gets a launcher that
    counts."""
    if call == HOST_FUNC:
        with _failing_host_func(nth, code) as fault:
            yield fault
        return
    driver = _driver()
    if call not in VALUES:
        raise KeyError(f"{call}: add the number of values its binding returns to VALUES")
    real = getattr(driver, call)
    fault = _Fault(call, nth, code)
    failure = (driver.CUresult(code),) + (None,) * VALUES[call]

    def patched(*args: Any, **kwargs: Any) -> Any:
        if _by_aiostream() and fault.takes(args):
            return failure
        result = real(*args, **kwargs)
        fault.shapes.add(len(result))
        return result

    patched.__name__ = patched.__qualname__ = call  # a release names the call it made
    setattr(driver, call, patched)
    try:
        yield fault
    finally:
        setattr(driver, call, real)
    assert fault.shapes <= {1 + VALUES[call]}, (
        f"{call}: the binding returns {sorted(fault.shapes)} item(s), VALUES says "
        f"{1 + VALUES[call]}"
    )


@contextlib.contextmanager
def _failing_host_func(nth: int, code: int) -> Iterator[_Fault]:
    driver = _driver()
    real_lookup = driver.cuGetProcAddress
    fault = _Fault(HOST_FUNC, nth, code)
    armed = [True]  # while the block runs: after it, its launchers only pass calls on

    def lookup(symbol: bytes, *args: Any) -> Any:
        result = real_lookup(symbol, *args)
        if symbol != HOST_FUNC.encode() or int(result[0]) != 0 or not result[1]:
            return result
        real = _LAUNCH(int(result[1]))

        def launch(stream: int | None, fn: int | None, data: int | None) -> int:
            if armed[0] and fault.takes((stream, fn, data)):
                return code
            return int(real(stream, fn, data))

        launcher = _LAUNCH(launch)
        _launchers.append(launcher)
        address = ctypes.cast(launcher, ctypes.c_void_p).value
        return (result[0], address, *result[2:])

    driver.cuGetProcAddress = lookup
    try:
        yield fault
    finally:
        driver.cuGetProcAddress = real_lookup
        armed[0] = False


@contextlib.contextmanager
def calls(*names: str) -> Iterator[dict[str, list[tuple[tuple[Any, ...], tuple[Any, ...]]]]]:
    """The calls aiostream makes of each entry point in ``names`` while the block runs: for
    each, its arguments and its result (the code first), in order; each call reaches the
    driver."""
    driver = _driver()
    seen: dict[str, list[tuple[tuple[Any, ...], tuple[Any, ...]]]] = {name: [] for name in names}
    lock = threading.Lock()

    def spying(real: Callable[..., Any], made: list[Any]) -> Any:
        def spy(*args: Any) -> Any:
            result = real(*args)
            if _by_aiostream():
                with lock:
                    made.append((args, result))
            return result

        spy.__name__ = spy.__qualname__ = real.__name__  # a release names the call it made
        return spy

    reals = {name: getattr(driver, name) for name in names}
    for name, real in reals.items():
        setattr(driver, name, spying(real, seen[name]))
    try:
        yield seen
    finally:
        for name, real in reals.items():
            setattr(driver, name, real)


def succeeded(made: list[tuple[tuple[Any, ...], tuple[Any, ...]]]) -> int:
    """How many of the calls :func:`calls` saw of one entry point returned CUDA_SUCCESS."""
    return sum(1 for _, result in made if int(result[0]) == 0)


def left_open(
    opened: list[tuple[tuple[Any, ...], tuple[Any, ...]]],
    closed: list[tuple[tuple[Any, ...], tuple[Any, ...]]],
) -> tuple[int, int]:
    """Of the handles the calls in ``opened`` gave (as :func:`calls` saw them: those of
    ``cuIpcOpenMemHandle``, say), how many there were, and how many no call in ``closed``
    (``cuIpcCloseMemHandle``) released with success."""
    given = [int(result[1]) for _, result in opened if int(result[0]) == 0]
    gone = {int(args[0]) for args, result in closed if int(result[0]) == 0}
    return len(given), sum(1 for handle in given if handle not in gone)
