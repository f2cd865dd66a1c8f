"""The stand-in driver keeps the CUDA driver API's documented contract: it refuses what the
documentation says is invalid, so that the CUDA backend's tests fail where a GPU would.

These talk to the driver through cuda-python's bindings directly (no aiostream), and run on every
driver where they check the documented contract: on a GPU they check that the stand-in models
the real driver. Its own counts are read where its hooks are; the refusals it counts as
violations are taken where it is the driver (``tests/helpers/driver_calls.py``: on the stand-in
built without its hooks, the tests that provoke them run in a child process). What only the
stand-in models (its exit report, its checks of undefined behaviour, its sleep kernel's time)
runs on either build of it; its hooks tested themselves, and fault injection, need the hooks.
"""

from __future__ import annotations

import ctypes
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.driver_calls import (
    Context,
    Word,
    code,
    devices,
    libc,
    ok,
    on_the_stand_in,
    provokes_violations,
    release_open_words,
    stand_in_only,
    take,
    violations,
)
from tests.helpers.process import run_python
from tests.helpers.stand_in import FAKE, OK, SLEEP_PTX

pytestmark = [pytest.mark.cuda]

if OK:  # a CUDA driver works: the stand-in's or a GPU's
    from cuda.bindings import driver as cu

INVALID_VALUE, INVALID_CONTEXT, INVALID_HANDLE, NOT_READY, LAUNCH_FAILED = 1, 201, 400, 600, 719


@pytest.fixture
def ctx0() -> Iterator[Context]:
    take()
    c = Context(0)
    yield c
    release_open_words()  # before the module's unload, which waits for all the device's work
    if FAKE is not None:
        FAKE.fake_cuda_clear_error()
    c.release()


@provokes_violations
def test_calls_on_a_contexts_objects_need_that_context_current(ctx0: Context) -> None:
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        event = ok(cu.cuEventCreate(2))
    assert int(ok(cu.cuCtxGetCurrent())) == 0  # no context current on this thread
    for result in (
        cu.cuEventRecord(event, stream),
        cu.cuEventQuery(event),
        cu.cuStreamQuery(stream),
        cu.cuStreamWaitEvent(stream, event, 0),
        cu.cuStreamCreate(1),
        cu.cuMemAllocAsync(64, stream),
        cu.cuMemHostAlloc(64, 0),
        cu.cuEventDestroy(event),
        cu.cuStreamDestroy(stream),
    ):
        assert code(result) == INVALID_CONTEXT
    violations(9, "with no current context")
    if devices() > 1:  # another device's context current is no better
        other = Context(1)
        with other:
            assert code(cu.cuEventRecord(event, stream)) == INVALID_CONTEXT
        other.release()
        violations(1, "on an object of cuda:0's context with cuda:1's context current")
    with ctx0:  # and with it current, all is well
        ok(cu.cuEventRecord(event, stream))
        ok(cu.cuEventSynchronize(event))
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(stream))
    violations(0)


@provokes_violations
def test_an_event_is_recorded_on_a_stream_of_its_context() -> None:
    if devices() < 2:
        pytest.skip("needs two devices")
    take()
    a, b = Context(0), Context(1)
    with a:
        event = ok(cu.cuEventCreate(2))
    with b:
        stream = ok(cu.cuStreamCreate(1))
        assert code(cu.cuEventRecord(event, stream)) == INVALID_HANDLE
        ok(cu.cuStreamDestroy(stream))
    with a:
        ok(cu.cuEventDestroy(event))
    a.release()
    b.release()
    violations(1, "an event of cuda:0 on a stream of cuda:1")


@pytest.mark.parametrize("flags", [1, 2])
@provokes_violations
def test_a_stream_waits_for_an_event_with_flags_0_only(ctx0: Context, flags: int) -> None:
    """``CU_EVENT_WAIT_EXTERNAL`` (1) is invalid outside stream capture, and no other flag
    exists: CUDA_ERROR_INVALID_VALUE, and a violation. (The reference says what the flag does
    in a capture only: a GPU's driver may take it outside one, where the stand-in takes the
    least forgiving reading.)"""
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        event = ok(cu.cuEventCreate(2))
        ok(cu.cuEventRecord(event, stream))
        result = code(cu.cuStreamWaitEvent(stream, event, flags))
        if flags == 1 and not on_the_stand_in():
            assert result in (0, INVALID_VALUE)
        else:
            assert result == INVALID_VALUE
        ok(cu.cuStreamWaitEvent(stream, event, 0))
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(stream))
    violations(1, f"cuStreamWaitEvent with flags {flags:#x}")


def test_a_wait_for_a_pending_record_keeps_its_stream_busy(ctx0: Context) -> None:
    """A wait is an operation of its stream: until the record it waits for completes (here
    held behind a gate), cuStreamQuery answers CUDA_ERROR_NOT_READY (on the legacy default
    stream too), and the context's synchronize waits for it; a wait for a completed record is
    over at once."""
    with ctx0:
        busy, waiting = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
        event = ok(cu.cuEventCreate(2))
        gate = Word().hold(busy)
        ok(cu.cuEventRecord(event, busy))
        for stream in (waiting, cu.CUstream(0)):
            ok(cu.cuStreamWaitEvent(stream, event, 0))
            assert code(cu.cuStreamQuery(stream)) == NOT_READY
        gate.release()
        ok(cu.cuCtxSynchronize())
        assert code(cu.cuEventQuery(event)) == 0
        for stream in (waiting, cu.CUstream(0)):
            assert code(cu.cuStreamQuery(stream)) == 0
            ok(cu.cuStreamWaitEvent(stream, event, 0))
            assert code(cu.cuStreamQuery(stream)) == 0
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(busy))
        ok(cu.cuStreamDestroy(waiting))
        gate.free()
    violations(0)


@pytest.mark.parametrize("call", ["cuMemFree", "cuModuleLoadData"])
def test_some_calls_wait_for_the_work_of_every_stream(ctx0: Context, call: str) -> None:
    """``cuMemFree`` (of ``cuMemAlloc``'s memory: its reference says it "may perform implicit
    synchronization") and ``cuModuleLoadData`` wait, as ``cuCtxSynchronize`` does, until the
    work of every stream of the device has completed: behind a stream memory wait nobody
    satisfies they hang, as an H100's did. The stream-ordered ``cuMemAllocAsync`` and
    ``cuMemFreeAsync`` never wait for other streams."""
    with ctx0:
        held, other = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
        dev = ok(cu.cuMemAlloc(16))
        gate = Word().hold(held)
        try:
            pooled = ok(cu.cuMemAllocAsync(16, other))
            ok(cu.cuMemFreeAsync(pooled, other))
            ok(cu.cuStreamSynchronize(other))
            results: list[Any] = []

            def make_the_call() -> None:
                ok(cu.cuCtxPushCurrent(ctx0.ctx))
                try:
                    arg = dev if call == "cuMemFree" else SLEEP_PTX
                    results.append(getattr(cu, call)(arg))
                finally:
                    ok(cu.cuCtxPopCurrent())

            thread = threading.Thread(target=make_the_call, daemon=True)
            thread.start()
            thread.join(0.2)
            assert thread.is_alive(), f"{call} returned while a stream was held"
            assert code(cu.cuStreamQuery(held)) == NOT_READY
        finally:
            gate.release()
        thread.join(5)
        assert not thread.is_alive(), f"{call} still blocked 5 s after the gate opened"
        assert code(results[0]) == 0, results
        if call == "cuModuleLoadData":
            ok(cu.cuModuleUnload(results[0][1]))
            ok(cu.cuMemFree(dev))
        ok(cu.cuStreamSynchronize(held))
        gate.free()
        for stream in (held, other):
            ok(cu.cuStreamDestroy(stream))


def test_copies_move_their_bytes_when_they_complete(ctx0: Context) -> None:
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        src = ok(cu.cuMemHostAlloc(16, 1))
        dst = ok(cu.cuMemHostAlloc(16, 1))
        dev = ok(cu.cuMemAllocAsync(16, stream))
        ctypes.memset(src, 7, 16)
        gate = Word().hold(stream)
        ok(cu.cuMemcpyHtoDAsync(dev, src, 16, stream))
        ok(cu.cuMemcpyDtoHAsync(dst, dev, 16, stream))
        time.sleep(0.01)
        assert ctypes.string_at(dst, 16) == bytes(16)  # not at the call
        assert code(cu.cuStreamQuery(stream)) == NOT_READY
        gate.release()
        ok(cu.cuStreamSynchronize(stream))
        assert ctypes.string_at(dst, 16) == bytes([7] * 16)
        ok(cu.cuMemFreeAsync(dev, stream))
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuMemFreeHost(src))
        ok(cu.cuMemFreeHost(dst))
        ok(cu.cuStreamDestroy(stream))
        gate.free()
    violations(0)


@pytest.mark.parametrize("flags", [0, 1, 2])
@provokes_violations
def test_a_value_written_lands_after_the_work_before_it(ctx0: Context, flags: int) -> None:
    """``cuStreamWriteValue32`` takes ``CU_STREAM_WRITE_VALUE_DEFAULT`` (0) only, whose memory
    barrier makes the work before it visible first: once its value is seen, the copy before
    it has moved its bytes. ``..._NO_MEMORY_BARRIER`` (1) "is not supported in the v2 API"
    (the one cuda-python calls; an H100 answered it ``CUDA_ERROR_INVALID_VALUE``), and nor is
    any other flag: ``CUDA_ERROR_INVALID_VALUE``, and a violation."""
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        src, dst = ok(cu.cuMemHostAlloc(16, 1)), ok(cu.cuMemHostAlloc(16, 1))
        flag = ok(cu.cuMemHostAlloc(4, 2))  # CU_MEMHOSTALLOC_DEVICEMAP
        ctypes.memset(src, 7, 16)
        ctypes.memset(flag, 0, 4)
        dev = ok(cu.cuMemAllocAsync(16, stream))
        assert ctx0.sleep(stream, 0.02) == 0
        ok(cu.cuMemcpyHtoDAsync(dev, src, 16, stream))
        ok(cu.cuMemcpyDtoHAsync(dst, dev, 16, stream))
        address = ok(cu.cuMemHostGetDevicePointer(flag, 0))
        result = code(cu.cuStreamWriteValue32(stream, address, 5, flags))
        seen = ctypes.c_uint32.from_address(int(flag))
        if flags:
            assert result == INVALID_VALUE
        else:
            assert result == 0
            deadline = time.monotonic() + 5
            while seen.value != 5 and time.monotonic() < deadline:
                time.sleep(0.0002)
            assert seen.value == 5, "waited 5 s in vain for the value to land"
            assert ctypes.string_at(dst, 16) == bytes([7] * 16)
        ok(cu.cuMemFreeAsync(dev, stream))
        ok(cu.cuStreamSynchronize(stream))
        assert ctypes.string_at(dst, 16) == bytes([7] * 16)
        if flags:
            assert seen.value == 0  # refused: nothing written
        for p in (src, dst, flag):
            ok(cu.cuMemFreeHost(p))
        ok(cu.cuStreamDestroy(stream))
    if flags:
        violations(1, f"cuStreamWriteValue32 with flags {flags:#x}")
    else:
        violations(0)


@provokes_violations
def test_freeing_memory_that_pending_work_uses_is_reported(ctx0: Context) -> None:
    stand_in_only("freeing memory that pending work uses is undefined behaviour on a GPU")
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        host = ok(cu.cuMemHostAlloc(16, 1))
        dev = ok(cu.cuMemAllocAsync(16, stream))
        assert ctx0.sleep(stream, 0.02) == 0
        ok(cu.cuMemcpyHtoDAsync(dev, host, 16, stream))
        ok(cu.cuMemFreeHost(host))  # the copy has not run yet
        other = ok(cu.cuStreamCreate(1))
        ok(cu.cuMemFreeAsync(dev, other))  # nothing orders this free after the copy
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuStreamSynchronize(other))
        ok(cu.cuStreamDestroy(stream))
        ok(cu.cuStreamDestroy(other))
    violations(  # and the copy itself then ran on freed memory: the third
        3,
        "cuMemFreeHost of pinned memory that 1 pending copies still use",
        "cuMemFreeAsync freed device memory that 1 pending operation(s) still use",
    )


@provokes_violations
def test_a_stream_ordered_allocation_is_used_elsewhere_only_after_it(ctx0: Context) -> None:
    stand_in_only("memory used before its stream-ordered allocation completed: undefined on a GPU")
    with ctx0:
        alloc, other = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
        host = ok(cu.cuMemHostAlloc(16, 1))
        assert ctx0.sleep(alloc, 0.02) == 0
        unordered = ok(cu.cuMemAllocAsync(16, alloc))
        ok(cu.cuMemcpyHtoDAsync(unordered, host, 16, other))
        ok(cu.cuStreamSynchronize(other))
        violations(1, "before the allocation completed")
        assert ctx0.sleep(alloc, 0.02) == 0
        ordered = ok(cu.cuMemAllocAsync(16, alloc))
        after = ok(cu.cuEventCreate(2))
        ok(cu.cuEventRecord(after, alloc))
        ok(cu.cuStreamWaitEvent(other, after, 0))
        ok(cu.cuMemcpyHtoDAsync(ordered, host, 16, other))
        ok(cu.cuCtxSynchronize())
        violations(0)
        for ptr in (unordered, ordered):
            ok(cu.cuMemFreeAsync(ptr, alloc))
        ok(cu.cuCtxSynchronize())
        ok(cu.cuMemFreeHost(host))
        ok(cu.cuEventDestroy(after))
        for s in (alloc, other):
            ok(cu.cuStreamDestroy(s))


@provokes_violations
def test_pinned_memory_of_another_context_needs_to_be_portable() -> None:
    if devices() < 2:
        pytest.skip("needs two devices")
    stand_in_only("pinned memory not portable, used in another context: undefined on a GPU")
    take()
    a, b = Context(0), Context(1)
    with a:
        plain = ok(cu.cuMemHostAlloc(16, 0))
        portable = ok(cu.cuMemHostAlloc(16, 1))  # CU_MEMHOSTALLOC_PORTABLE
    with b:
        stream = ok(cu.cuStreamCreate(1))
        dev = ok(cu.cuMemAlloc(16))
        ok(cu.cuMemcpyHtoDAsync(dev, portable, 16, stream))
        violations(0)
        ok(cu.cuMemcpyHtoDAsync(dev, plain, 16, stream))
        ok(cu.cuStreamSynchronize(stream))
        violations(1, "without CU_MEMHOSTALLOC_PORTABLE")
        ok(cu.cuMemFree(dev))
        ok(cu.cuStreamDestroy(stream))
    with a:
        ok(cu.cuMemFreeHost(plain))
        ok(cu.cuMemFreeHost(portable))
    a.release()
    b.release()


@pytest.mark.stand_in(
    "fault injection: a kernel failing on the device (fake_cuda_fail_next_launch), its sticky "
    "error cleared (fake_cuda_clear_error)"
)
def test_a_sticky_error_belongs_to_its_context_and_stops_host_functions(ctx0: Context) -> None:
    sem = ctypes.create_string_buffer(64)
    libc.sem_init(sem, 0, 0)
    launch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
        ok(cu.cuGetProcAddress(b"cuLaunchHostFunc", 10000, 0))[0]
    )
    post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        assert launch(int(stream), post, ctypes.addressof(sem)) == 0  # runs: a C function
        ok(cu.cuStreamSynchronize(stream))
        FAKE.fake_cuda_fail_next_launch(LAUNCH_FAILED)
        assert ctx0.sleep(stream, 0.01) == 0
        assert launch(int(stream), post, ctypes.addressof(sem)) == 0  # after the fault
        assert code(cu.cuStreamSynchronize(stream)) == LAUNCH_FAILED
        assert code(cu.cuStreamCreate(1)) == LAUNCH_FAILED  # every later call in the context
        value = ctypes.c_int()
        libc.sem_getvalue(sem, ctypes.byref(value))
        assert value.value == 1  # the host function after the fault never ran
        FAKE.fake_cuda_clear_error()  # (a real context stays failed)
        ok(cu.cuStreamDestroy(stream))
    if devices() > 1:
        other = Context(1)
        with other:  # another device's context is not failed
            s = ok(cu.cuStreamCreate(1))
            ok(cu.cuStreamSynchronize(s))
            ok(cu.cuStreamDestroy(s))
        other.release()
    violations(0)


@provokes_violations
def test_a_host_function_that_runs_python_is_reported(ctx0: Context) -> None:
    """cuda-python's own cuLaunchHostFunc launches a wrapper that takes the GIL on the driver's
    thread, whatever function it is given: the stand-in reports it as Python (and runs it, as
    a GPU's driver does)."""
    sem = ctypes.create_string_buffer(64)
    libc.sem_init(sem, 0, 0)
    post = cu.CUhostFn(ctypes.cast(libc.sem_post, ctypes.c_void_p).value)
    before = FAKE.fake_cuda_host_calls_python() if FAKE is not None else 0
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        ok(cu.cuLaunchHostFunc(stream, post, ctypes.addressof(sem)))
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuStreamDestroy(stream))
    value = ctypes.c_int()
    libc.sem_getvalue(sem, ctypes.byref(value))
    assert value.value == 1  # it ran
    if FAKE is not None:
        assert FAKE.fake_cuda_host_calls_python() == before + 1
    violations(1, "no C function of a loaded library")


@pytest.mark.stand_in("its hook fake_cuda_fail_call, tested itself")
def test_a_chosen_call_fails_on_its_nth_call(ctx0: Context) -> None:
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        event = ok(cu.cuEventCreate(2))
        assert FAKE.fake_cuda_fail_call(b"cuEventRecord", 2, 999)
        ok(cu.cuEventRecord(event, stream))
        assert code(cu.cuEventRecord(event, stream)) == 999
        ok(cu.cuEventRecord(event, stream))
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(stream))
    # entry points that touch no object fail the same way, and only the one asked for
    assert FAKE.fake_cuda_fail_call(b"cuCtxPushCurrent", 1, 999)
    assert FAKE.fake_cuda_fail_call(b"cuDeviceGet", 2, 2)
    assert code(cu.cuCtxPushCurrent(ctx0.ctx)) == 999
    assert int(ok(cu.cuCtxGetCurrent())) == 0  # it did nothing
    ok(cu.cuDeviceGet(0))
    assert code(cu.cuDeviceGet(0)) == 2
    ok(cu.cuDeviceGet(0))
    with ctx0:  # pushed now
        assert int(ok(cu.cuCtxGetCurrent())) == int(ctx0.ctx)
    violations(0)


def test_kernel_launches_keep_the_device_limits(ctx0: Context) -> None:
    """cuLaunchKernel refuses a launch no device takes (CUDA_ERROR_INVALID_VALUE): a grid or
    block dimension of 0, more than 1024 threads a block, more than 48 KiB of dynamic shared
    memory; a launch it takes is recorded for the tests (where the stand-in's hooks are), grid,
    block and shared memory."""
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        assert ctx0.sleep(stream, 0.0) == 0
        fn = ok(cu.cuModuleGetFunction(ctx0.module, b"aiostream_sleep"))
        args = ((0,), (ctypes.c_uint64,))
        for dims in (
            (0, 1, 1, 1, 1, 1, 0),
            (1, 1, 0, 1, 1, 1, 0),
            (1, 1, 1, 0, 1, 1, 0),
            (1, 1, 1, 1, 1, 0, 0),
            (1, 1, 1, 1025, 1, 1, 0),
            (1, 1, 1, 32, 32, 2, 0),
            (1, 1, 1, 1, 1, 1, 48 * 1024 + 1),
        ):
            assert code(cu.cuLaunchKernel(fn, *dims, stream, args, 0)) == 1, dims
        ok(cu.cuLaunchKernel(fn, 2, 3, 4, 32, 32, 1, 48 * 1024, stream, args, 0))
        if FAKE is not None:
            launch = (ctypes.c_uint * 7)()
            FAKE.fake_cuda_last_launch(launch)
            assert list(launch) == [2, 3, 4, 32, 32, 1, 48 * 1024]
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuStreamDestroy(stream))
    violations(0)


@pytest.mark.stand_in("its hook fake_cuda_fail_call, tested itself: a failed call does nothing")
def test_a_failed_call_has_no_effect(ctx0: Context) -> None:
    """A call made to fail returns its code before it does anything: no stream is made, no
    operation is submitted, and the sticky error of the context is untouched."""
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        live = FAKE.fake_cuda_live(0)
        assert FAKE.fake_cuda_fail_call(b"cuStreamCreateWithPriority", 1, 2)
        assert code(cu.cuStreamCreateWithPriority(1, 0)) == 2  # CUDA_ERROR_OUT_OF_MEMORY
        assert FAKE.fake_cuda_live(0) == live
        start = time.perf_counter()
        assert ctx0.sleep(stream, 0.01) == 0
        assert FAKE.fake_cuda_fail_call(b"cuLaunchKernel", 1, 999)
        fn = ok(cu.cuModuleGetFunction(ctx0.module, b"aiostream_sleep"))
        args = ((60 * 10**9,), (ctypes.c_uint64,))  # a minute's sleep, were it launched
        assert code(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, args, 0)) == 999
        ok(cu.cuStreamSynchronize(stream))
        assert time.perf_counter() - start < 30
        ok(cu.cuStreamDestroy(stream))
    violations(0)


def test_priorities_are_recorded(ctx0: Context) -> None:
    """A priority in the context's range is kept; one outside it is clamped, as the driver
    documents (the stand-in's range: -5 greatest, 0 least, as recent GPUs')."""
    with ctx0:
        least, greatest = ok(cu.cuCtxGetStreamPriorityRange())
        if on_the_stand_in():
            assert (least, greatest) == (0, -5)
        middle = max(greatest, -3)
        stream = ok(cu.cuStreamCreateWithPriority(1, middle))
        if FAKE is not None:
            assert FAKE.fake_cuda_stream_priority(int(stream)) == middle
        assert ok(cu.cuStreamGetPriority(stream)) == middle
        ok(cu.cuStreamDestroy(stream))
        for asked, kept in ((greatest - 4, greatest), (least + 4, least)):
            stream = ok(cu.cuStreamCreateWithPriority(1, asked))
            if FAKE is not None:
                assert FAKE.fake_cuda_stream_priority(int(stream)) == kept
            assert ok(cu.cuStreamGetPriority(stream)) == kept
            ok(cu.cuStreamDestroy(stream))
    if FAKE is not None:
        assert FAKE.fake_cuda_stream_priority(None) == -100


def test_event_flags_are_recorded(ctx0: Context) -> None:
    """Each combination is taken (read back where the stand-in's hooks are); an event without
    timing has no elapsed time (CUDA_ERROR_INVALID_HANDLE, as documented)."""
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        for flags in (0, 1, 2, 3, 6, 7):  # BLOCKING_SYNC 1, DISABLE_TIMING 2, INTERPROCESS 4
            event = ok(cu.cuEventCreate(flags))
            if FAKE is not None:
                assert FAKE.fake_cuda_event_flags(int(event)) == flags
            ok(cu.cuEventRecord(event, stream))
            ok(cu.cuEventSynchronize(event))
            timed = code(cu.cuEventElapsedTime(event, event))
            assert timed == (INVALID_HANDLE if flags & 2 else 0), (flags, timed)
            ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(stream))
        # interprocess needs timing disabled, as the driver documents
        assert code(cu.cuEventCreate(4)) == INVALID_VALUE
    if FAKE is not None:
        assert FAKE.fake_cuda_event_flags(None) == -1


# ---------------------------------------------------------------------- in a process of its own


def _run(code_: str, **env: str) -> Any:
    """Run the program on the stand-in (either build: the tests of its exit report and of
    what it models of a GPU skip elsewhere)."""
    stand_in_only("its exit report, and what a program leaves at exit")
    return run_python("-c", PRELUDE + textwrap.dedent(code_), **env)


PRELUDE = """
import ctypes
from cuda.bindings import driver as cu
cu.cuInit(0)
ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1]
cu.cuCtxPushCurrent(ctx)
lib = ctypes.CDLL("libcuda.so.1")
HOOKS = hasattr(lib, "fake_cuda_live")  # the stand-in's, where it is built with them


def gate(stream):  # hold the stream's later work (a memory wait) until the word is 1
    word = cu.cuMemHostAlloc(4, 3)[1]  # portable, mapped for the device
    ctypes.memset(word, 0, 4)
    address = cu.cuMemHostGetDevicePointer(word, 0)[1]
    assert int(cu.cuStreamWaitValue32(stream, address, 1, 0)[0]) == 0
    return ctypes.c_uint32.from_address(int(word))
"""


def test_freed_pinned_memory_is_unmapped_and_touching_it_crashes() -> None:
    """(A GPU's driver unmaps it too, as far as is known; its pages could also be kept for
    reuse, which the documentation leaves open: this checks the stand-in's model.)"""
    proc = _run(
        """
        p = cu.cuMemHostAlloc(4096, 0)[1]
        ctypes.memset(p, 1, 4096)
        cu.cuMemFreeHost(p)
        print("freed", flush=True)
        ctypes.memset(p, 2, 4096)
        print("survived", flush=True)
        """
    )
    assert "freed" in proc.stdout and "survived" not in proc.stdout
    assert proc.returncode == -11  # SIGSEGV, as on a GPU's unmapped pages


def test_at_exit_it_reports_violations_and_fails_the_process() -> None:
    proc = _run("cu.cuCtxPopCurrent()\ncu.cuStreamCreate(1)\ncu.cuCtxPushCurrent(ctx)")
    assert proc.returncode == 70, proc.stderr
    assert "fake_cuda: at exit: 1 violation(s)" in proc.stderr
    assert "cuStreamCreateWithPriority with no current context" in proc.stderr


def test_at_exit_it_reports_live_handles_unless_relaxed() -> None:
    leak = "cu.cuStreamCreate(1)"
    proc = _run(leak)
    assert proc.returncode == 70 and "1 live handle(s), 1 stream" in proc.stderr
    assert _run(leak, FAKE_CUDA_RELAX="exit").returncode == 0


@pytest.mark.parametrize("last_query", ["busy", "idle", "none", "event-busy", "event-then-idle"])
def test_a_context_last_seen_busy_may_be_left_to_exit(last_query: str) -> None:
    """A program that saw its work pending (a ``cuEventQuery``, or its last ``cuStreamQuery``,
    said NOT_READY) may leave the context to the exit rather than wait; its handles are not
    reported, even if the work completed since. A context seen idle since, or never asked,
    has no such excuse, but for its memory: the program may still read it, and the exit frees
    it with the context."""
    proc = _run(
        f"""
        import time
        stream = cu.cuStreamCreate(1)[1]
        event = cu.cuEventCreate(2)[1]
        p = cu.cuMemAlloc(16)[1]
        word = gate(stream)
        cu.cuEventRecord(event, stream)
        if {last_query!r} == "busy":
            assert int(cu.cuStreamQuery(stream)[0]) == 600
        if {last_query!r}.startswith("event"):
            assert int(cu.cuEventQuery(event)[0]) == 600
        word.value = 1
        time.sleep(0.1)  # the work completes before the exit
        if {last_query!r} in ("idle", "event-then-idle"):
            assert int(cu.cuStreamQuery(stream)[0]) == 0
        """
    )
    if last_query in ("busy", "event-busy"):
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 70, proc.stderr
        assert "2 live handle(s), 1 stream, 1 event\n" in proc.stderr, proc.stderr


USED_BY_ANOTHER = """
import time
ctx1 = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(1)[1])[1]
host = cu.cuMemHostAlloc(16, 1)[1]  # portable pinned memory of cuda:0
mine = cu.cuStreamCreate(1)[1]  # and a stream of cuda:0 nothing else excuses
cu.cuCtxPushCurrent(ctx1)
other = cu.cuStreamCreate(1)[1]
dev = cu.cuMemAlloc(16)[1]
word = gate(other)  # cuda:1 held until the word is set
cu.cuMemcpyHtoDAsync(dev, host, 16, other)  # then reads cuda:0's memory
cu.cuCtxPopCurrent()
"""


def test_a_reset_under_another_devices_pending_work_on_its_memory_is_reported() -> None:
    """Releasing a context frees its pinned memory: while a copy pending on another device
    still reads it, that is a violation (and the memory a leak)."""
    if devices() < 2:
        pytest.skip("needs two devices")
    proc = _run(
        USED_BY_ANOTHER
        + "cu.cuStreamDestroy(mine)\ncu.cuCtxPopCurrent()\ncu.cuDevicePrimaryCtxRelease(0)\n"
    )
    assert proc.returncode == 70, proc.stderr
    assert "cuda:0's context was reset while work pending on another device uses a pinned " in (
        proc.stderr
    )


@pytest.mark.parametrize("seen_busy", [True, False])
def test_memory_left_to_exit_is_excused_but_not_streams(seen_busy: bool) -> None:
    """At exit, memory still allocated is excused (the program may still read it, or another
    device's pending work: the exit frees it); streams are not, but in a context the program
    saw busy."""
    if devices() < 2:
        pytest.skip("needs two devices")
    seen = "cu.cuCtxPushCurrent(ctx1)\nassert int(cu.cuStreamQuery(other)[0]) == 600\n"
    done = "word.value = 1\ntime.sleep(0.1)\n"  # the copy completes before the exit
    proc = _run(USED_BY_ANOTHER + (seen if seen_busy else "") + done)
    assert proc.returncode == 70, proc.stderr
    if seen_busy:
        assert "1 live handle(s), 1 stream\n" in proc.stderr, proc.stderr
    else:
        assert "2 live handle(s), 2 stream\n" in proc.stderr, proc.stderr


def test_the_report_is_quiet_when_all_is_well() -> None:
    proc = _run("cu.cuCtxPopCurrent()\ncu.cuDevicePrimaryCtxRelease(0)")
    assert proc.returncode == 0 and proc.stderr == ""


def test_releasing_the_last_reference_resets_the_context() -> None:
    proc = _run(
        """
        stream = cu.cuStreamCreate(1)[1]
        cu.cuMemHostAlloc(16, 1)
        cu.cuCtxPopCurrent()
        cu.cuDevicePrimaryCtxRelease(0)
        if HOOKS:
            print("live", lib.fake_cuda_live(0), lib.fake_cuda_live(3), flush=True)
        cu.cuCtxPushCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
        print("query", int(cu.cuStreamQuery(stream)[0]), flush=True)
        """
    )
    seen = ("live 0 0\n" if FAKE is not None else "") + "query 400\n"
    assert seen in proc.stdout, proc.stdout + proc.stderr
    assert "2 handle(s) leaked at a context reset" in proc.stderr  # both were still alive
    assert "used after it was destroyed with its context" in proc.stderr
    assert proc.returncode == 70


def test_time_passes_for_device_work_as_it_does_on_a_gpu(ctx0: Context) -> None:
    stand_in_only("its sleep kernel takes its time (on a GPU it returns at once)")
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        start = time.perf_counter()
        assert ctx0.sleep(stream, 0.05) == 0
        assert code(cu.cuStreamQuery(stream)) == NOT_READY
        ok(cu.cuStreamSynchronize(stream))
        assert 0.045 <= time.perf_counter() - start < 1.0
        ok(cu.cuStreamDestroy(stream))
