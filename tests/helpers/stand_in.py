"""The stand-in driver's test hooks (tests/fake_cuda/fake_cuda.c), where it is the driver.

``FAKE`` is None on a real GPU and where no CUDA driver works; tests that need the hooks are
marked ``needs_stand_in`` and skip then (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
from collections.abc import Iterator
from typing import Any

import pytest

from aiostream import _backends

OK, REASON = _backends.probe("cuda")
#: the skip reason of tests that need a CUDA device, short: the detail is said once elsewhere
NO_CUDA = "needs a CUDA device (python -m aiostream info says why)"

#: a module with the one kernel the stand-in runs, ``aiostream_sleep`` (its parameter: the time
#: to sleep, in nanoseconds); the stand-in reads no more of the image than its entry's name
SLEEP_PTX = b"""
.version 7.0
.target sm_52
.address_size 64

.visible .entry aiostream_sleep(.param .u64 aiostream_sleep_param_0)
{
    ret;
}
\0"""

# fake_cuda_live kinds
STREAMS, EVENTS, CONTEXTS, PINNED, DEVICE_BUFFERS, MODULES = range(6)


def _load() -> Any:
    if not OK:
        return None
    lib = ctypes.CDLL("libcuda.so.1")
    if not hasattr(lib, "fake_cuda_live"):
        return None
    for name in (
        "fake_cuda_live",
        "fake_cuda_violations",
        "fake_cuda_host_calls",
        "fake_cuda_host_calls_python",
        "fake_cuda_take_violations",
        "fake_cuda_take_leaks",
        "fake_cuda_pending",
        "fake_cuda_captures_invalidated",
        "fake_cuda_graph_nodes_run",
        "fake_cuda_open_captures",
        "fake_cuda_graphs_live",
    ):
        getattr(lib, name).restype = ctypes.c_long
    lib.fake_cuda_take_violations.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.fake_cuda_touch.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_size_t,
        ctypes.c_uint64,
    ]
    lib.fake_cuda_fail_call.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_int]
    lib.fake_cuda_relax.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.fake_cuda_stream_priority.argtypes = [ctypes.c_void_p]
    lib.fake_cuda_last_launch.argtypes = [ctypes.POINTER(ctypes.c_uint)]
    lib.fake_cuda_last_launch.restype = None
    lib.fake_cuda_event_flags.argtypes = [ctypes.c_void_p]
    lib.fake_cuda_host_fn_delay.argtypes = [ctypes.c_uint64]
    lib.fake_cuda_host_fn_return_delay.argtypes = [ctypes.c_uint64]
    lib.fake_cuda_write_delay.argtypes = [ctypes.c_uint64]
    lib.fake_cuda_hurry_within.argtypes = [ctypes.c_uint64]
    # stream capture and graphs
    for name in ("fake_cuda_captures_invalidated", "fake_cuda_graph_nodes_run"):
        getattr(lib, name).argtypes = []
    lib.fake_cuda_open_captures.argtypes = []
    lib.fake_cuda_graphs_live.argtypes = [ctypes.c_int]
    return lib


FAKE = _load()
#: a test that uses the hooks: it skips where the stand-in is not the driver (tests/conftest.py)
needs_stand_in = pytest.mark.stand_in


@functools.cache
def on_the_stand_in() -> bool:
    """Whether the driver is the stand-in of ``tests/fake_cuda``, built with its hooks or
    without them (``--no-hooks``: then only its devices' name tells it from a GPU's driver)."""
    if FAKE is not None:
        return True
    if not OK:
        return False
    from cuda.bindings import driver

    driver.cuInit(0)
    err, name = driver.cuDeviceGetName(64, driver.CUdevice(0))
    return int(err) == 0 and bytes(name).startswith(b"aiostream fake GPU")


def skip_on_a_stand_in_without_hooks() -> None:
    """Skip a test that makes the driver refuse a call on purpose where the driver is the
    stand-in built without its hooks (``--no-hooks``): it counts the refusal as a violation no
    hook can take, which fails the process at exit. On a GPU such a test checks that the
    driver refuses the call as the stand-in does; with the hooks, the test takes it."""
    if FAKE is None and on_the_stand_in():
        pytest.skip("a refusal the stand-in counts, without hooks to take it, fails the exit")


def take_violations() -> tuple[int, str]:
    """How many contract violations the stand-in counted since the last call, and the last
    ones described; the count starts again from zero."""
    buf = ctypes.create_string_buffer(8192)
    n = FAKE.fake_cuda_take_violations(buf, len(buf))
    return int(n), buf.value.decode()


def assert_no_violations() -> None:
    n, log = take_violations()
    assert n == 0, f"{n} violation(s) of the driver's contract:\n{log}"


@contextlib.contextmanager
def keeping_the_contract() -> Iterator[None]:
    """The block (a test) starts with no violation counted on the stand-in, and must end
    with none, once what it dropped is collected; nothing on a GPU."""
    if FAKE is not None:
        take_violations()
    yield
    if FAKE is not None:
        gc.collect()
        assert_no_violations()


def hurry() -> None:
    """End now every operation due later (a "kernel that never ends" a test launched), so the
    tests after it, which share the primary contexts, do not wait behind it; nothing on a
    GPU."""
    if FAKE is not None:
        FAKE.fake_cuda_hurry()


def touch(stream: Any, ptr: int, nbytes: int, seconds: float = 0.0) -> None:
    """A kernel on ``stream`` (an aiostream Stream) that reads ``nbytes`` at ``ptr`` when it
    runs, ``seconds`` long: a user's kernel using a buffer."""
    handle = stream.stream_id or None  # 0: the device's default stream
    rc = FAKE.fake_cuda_touch(stream.device.index, handle, ptr, nbytes, round(seconds * 1e9))
    assert rc == 0, "fake_cuda_touch: unknown stream or memory"
