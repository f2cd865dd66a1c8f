"""Calls to the CUDA driver through cuda-python's bindings, without aiostream, for the tests of
the stand-in driver itself: a result's checks, a retained primary context, the sleep kernel,
and libc's semaphore functions (C functions the driver can call as host functions)."""

from __future__ import annotations

import ctypes
from typing import Any

from tests.helpers.stand_in import SLEEP_PTX

libc = ctypes.CDLL(None)
libc.sem_post.argtypes = libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
libc.sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]


def ok(result: tuple[Any, ...]) -> Any:
    """A binding's result whose code must be CUDA_SUCCESS: its value(s)."""
    assert int(result[0]) == 0, result
    return result[1] if len(result) == 2 else result[1:]


def code(result: tuple[Any, ...]) -> int:
    """A binding's result code."""
    return int(result[0])


class Context:
    """A device's primary context, retained for a test and pushed on demand."""

    def __init__(self, index: int) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.index = index
        self.ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(index))))
        self.module: Any = None

    def __enter__(self) -> Context:
        ok(self.cu.cuCtxPushCurrent(self.ctx))
        return self

    def __exit__(self, *exc: object) -> None:
        ok(self.cu.cuCtxPopCurrent())

    def release(self) -> None:
        if self.module is not None:
            with self:
                ok(self.cu.cuModuleUnload(self.module))
        ok(self.cu.cuDevicePrimaryCtxRelease(ok(self.cu.cuDeviceGet(self.index))))

    def sleep(self, stream: Any, seconds: float) -> int:
        """The sleep kernel on ``stream`` (context pushed by the caller); its result code."""
        cu = self.cu
        if self.module is None:
            self.module = ok(cu.cuModuleLoadData(SLEEP_PTX))
        fn = ok(cu.cuModuleGetFunction(self.module, b"aiostream_sleep"))
        args = ((round(seconds * 1e9),), (ctypes.c_uint64,))
        return code(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, args, 0))
