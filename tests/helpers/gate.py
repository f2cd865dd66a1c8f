"""Gates: a stream's work held on the device until the test lets it go, as a GPU allows it.

A test that needs device work to stay pending (a wait not over yet, a query that says "not
ready", a synchronization that blocks) gates the stream, rather than launching a kernel that
never ends: such a kernel ends only through the stand-in driver's hook ``fake_cuda_hurry()``,
which no GPU has, so every test built on it skips on a real driver. ``release = gate(s)``
enqueues a stream memory wait (``cuStreamWaitValue32``, greater or equal to 1) on a word of
pinned host memory mapped for the device; whatever is submitted to ``s`` after it waits, on
the device, until ``release()`` stores 1 into that word from the host. A gate takes the
public driver API only (cuda-python's bindings), never a hook, so the same test runs on a GPU
and on the stand-in of ``tests/fake_cuda``, which implements the stream memory operations as
the driver API reference documents them (also when built without its hooks, as a GPU's driver
is seen: ``python -m tests.helpers.fake_cuda --no-hooks FOLDER``)::

    with gated(s):  # released on exit, also when the block fails: no device is left held
        ais.delay(0.001, stream=s)
        assert not s.query()
    s.synchronize_blocking()

A gate's word is 0 while held, 1 once released (the host's store) and 2 once passed: the
device writes 2 right after the wait (``cuStreamWriteValue32``), so the word's memory is freed
only when the device reads it no more, at the next ``gate()``, ``release()`` or ``sweep()``;
what is left at exit goes with the context. The words belong to the device's primary context,
which the stream's backend holds: do not reset that context (release its last reference)
while a gate's word lives.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import aiostream as ais
from tests.helpers.cuda import primary_context

HELD, RELEASED, PASSED = 0, 1, 2  # a gate's word
PORTABLE_DEVICEMAP = 0x1 | 0x2  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
WAIT_VALUE_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
CAN_MAP_HOST_MEMORY = 19  # CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY
NOT_SUPPORTED = 801  # CUDA_ERROR_NOT_SUPPORTED


class _Word:
    """One gate's word of pinned memory mapped for the device."""

    __slots__ = ("host", "index", "released")

    def __init__(self, index: int, host: int) -> None:
        self.index = index
        self.host = host
        self.released = False

    @property
    def value(self) -> int:
        return int(ctypes.c_uint32.from_address(self.host).value)

    def store(self, value: int) -> None:
        """A host store the device sees (each ctypes assignment writes the memory)."""
        ctypes.c_uint32.from_address(self.host).value = value


_lock = threading.Lock()
_words: list[_Word] = []  # not freed yet: held, released, or passed since the last sweep
_exit_registered = False


def _at_exit() -> None:
    """Before aiostream's backend closes at exit and its context is reset: every gate
    released and, once the device has passed it (a second at most), its word freed, so
    that no word is left to the reset (which would count it leaked)."""
    release_all()
    deadline = time.monotonic() + 1.0
    while sweep() and time.monotonic() < deadline:
        time.sleep(0.001)


def _register_exit() -> None:
    """atexit runs the last registered first: registered at the first gate, after aiostream
    registered its backend's close (the stream exists), ``_at_exit`` runs before it."""
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_at_exit)


def _ok(result: tuple[Any, ...], call: str, index: int) -> Any:
    code = int(result[0])
    if code != 0:
        raise RuntimeError(f"gate: {call} failed on cuda:{index} with CUresult {code}")
    return result[1] if len(result) == 2 else None


def gate(stream: ais.Stream) -> Callable[[], None]:
    """Hold the work submitted to ``stream`` from now on until the returned ``release()``
    is called (idempotent, from any thread); what is already queued runs as usual.

    ``stream`` is a CUDA stream of its own (not the legacy default stream, ``stream_id`` 0,
    nor a capturing one); a kernel of no length (``ais.delay(0)``) is queued on an
    ``ais.Stream`` first. Skips the test where the device cannot map host memory, or where
    its driver does not support stream memory operations (``CUDA_ERROR_NOT_SUPPORTED``; the
    32-bit wait of the API since CUDA 12 needs no attribute, the 64-bit one and NOR do).
    """
    if stream.device_type != "cuda":
        raise TypeError(
            f"gate() holds a CUDA stream's work on the device; {stream.device} is a virtual "
            "device: hold its work by the virtual device's own means (its clock, a delay)"
        )
    if stream.stream_id == 0:
        raise ValueError(
            "gate() takes a stream of its own, not the legacy default stream (stream_id 0): a "
            "wait there would hold every blocking stream of the context"
        )
    index = stream.device_index
    _register_exit()
    sweep()
    # the sleep kernel's module loads at a device's first ais.delay, and loading a module
    # waits for the device's work (an H100's cuModuleLoadData waited behind a held stream):
    # loaded before the gate holds anything, by a delay of no length (a bare handle of a
    # stream of aiostream's, as a test's driver hook passes, has had its delay already)
    if isinstance(stream, ais.Stream):
        ais.delay(0.0, stream=stream)
    with primary_context(index) as cu:
        device = _ok(cu.cuDeviceGet(index), "cuDeviceGet", index)
        attr = cu.CUdevice_attribute(CAN_MAP_HOST_MEMORY)
        if not _ok(cu.cuDeviceGetAttribute(attr, device), "cuDeviceGetAttribute", index):
            pytest.skip(f"cuda:{index} cannot map host memory: no gate (stream memory wait)")
        handle = cu.CUstream(stream.stream_id)
        status = _ok(cu.cuStreamIsCapturing(handle), "cuStreamIsCapturing", index)
        if int(status) != 0:
            raise ValueError("gate() holds a stream's work, not a capture's: the stream captures")
        host = int(_ok(cu.cuMemHostAlloc(4, PORTABLE_DEVICEMAP), "cuMemHostAlloc", index))
        word = _Word(index, host)
        word.store(HELD)
        try:
            address = _ok(cu.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer", index)
            (err,) = cu.cuStreamWaitValue32(handle, address, RELEASED, WAIT_VALUE_GEQ)
            if int(err) == NOT_SUPPORTED:
                pytest.skip(f"cuda:{index}'s driver does not support stream memory operations")
            _ok((err,), "cuStreamWaitValue32", index)
        except BaseException:
            cu.cuMemFreeHost(host)  # nothing waits on it
            raise
        # the device says when it reads the word no more: its memory may be freed then
        result = cu.cuStreamWriteValue32(handle, address, PASSED, 0)
        with _lock:
            _words.append(word)
        if int(result[0]) != 0:
            word.released = True  # let the stream go; the word stays to the exit
            word.store(RELEASED)
            _ok(result, "cuStreamWriteValue32", index)

    def release() -> None:
        with _lock:
            if word.released:
                return
            word.released = True
            word.store(RELEASED)
        sweep()

    return release


@contextlib.contextmanager
def gated(stream: ais.Stream) -> Iterator[Callable[[], None]]:
    """``gate(stream)`` for the block, released on its exit, also when it fails; the block
    gets ``release`` (to let the work go earlier)."""
    release = gate(stream)
    try:
        yield release
    finally:
        release()


def sweep() -> int:
    """Free the words of the gates the device has passed; how many words are left (gates
    held, or released and not passed yet)."""
    with _lock:
        passed = [w for w in _words if w.released and w.value == PASSED]
        for w in passed:
            _words.remove(w)
        left = len(_words)
    for index in sorted({w.index for w in passed}):
        with primary_context(index) as cu:
            for w in passed:
                if w.index == index:
                    _ok(cu.cuMemFreeHost(w.host), "cuMemFreeHost", index)
    return left


def release_all() -> int:
    """Release every gate still held (a test that forgot one); how many there were."""
    with _lock:
        held = [w for w in _words if not w.released]
        for w in held:
            w.released = True
            w.store(RELEASED)
    return len(held)
