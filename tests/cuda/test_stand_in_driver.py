"""The stand-in driver keeps the CUDA driver API's documented contract: it refuses what the
documentation says is invalid, so that the CUDA backend's tests fail where a GPU would.

These talk to the stand-in through cuda-python's bindings directly (no aiostream), and run only
where it is the driver (CI's CUDA lane runs this file against it, with one and two devices).
"""

from __future__ import annotations

import ctypes
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.driver_calls import Context, code, libc, ok
from tests.helpers.process import run_python
from tests.helpers.stand_in import FAKE, take_violations

pytestmark = [pytest.mark.cuda, pytest.mark.stand_in]

if FAKE is not None:
    from cuda.bindings import driver as cu

INVALID_VALUE, INVALID_CONTEXT, INVALID_HANDLE, NOT_READY, LAUNCH_FAILED = 1, 201, 400, 600, 719


@pytest.fixture
def ctx0() -> Iterator[Context]:
    take_violations()
    c = Context(0)
    yield c
    FAKE.fake_cuda_clear_error()
    c.release()


def devices() -> int:
    return int(ok(cu.cuDeviceGetCount()))


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
    n, log = take_violations()
    assert n == 9 and "with no current context" in log
    if devices() > 1:  # another device's context current is no better
        other = Context(1)
        with other:
            assert code(cu.cuEventRecord(event, stream)) == INVALID_CONTEXT
        other.release()
        n, log = take_violations()
        assert n == 1 and "on an object of cuda:0's context with cuda:1's context current" in log
    with ctx0:  # and with it current, all is well
        ok(cu.cuEventRecord(event, stream))
        ok(cu.cuEventSynchronize(event))
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(stream))
    assert take_violations()[0] == 0


def test_an_event_is_recorded_on_a_stream_of_its_context() -> None:
    if devices() < 2:
        pytest.skip("needs two devices")
    take_violations()
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
    n, log = take_violations()
    assert n == 1 and "an event of cuda:0 on a stream of cuda:1" in log


@pytest.mark.parametrize("flags", [1, 2])
def test_a_stream_waits_for_an_event_with_flags_0_only(ctx0: Context, flags: int) -> None:
    """``CU_EVENT_WAIT_EXTERNAL`` (1) is invalid outside stream capture, and no other flag
    exists: CUDA_ERROR_INVALID_VALUE, and a violation."""
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        event = ok(cu.cuEventCreate(2))
        ok(cu.cuEventRecord(event, stream))
        assert code(cu.cuStreamWaitEvent(stream, event, flags)) == INVALID_VALUE
        ok(cu.cuStreamWaitEvent(stream, event, 0))
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(stream))
    n, log = take_violations()
    assert n == 1 and f"cuStreamWaitEvent with flags {flags:#x}" in log, log


def test_a_wait_for_a_pending_record_keeps_its_stream_busy(ctx0: Context) -> None:
    """A wait is an operation of its stream: until the record it waits for completes,
    cuStreamQuery answers CUDA_ERROR_NOT_READY (on the legacy default stream too), and the
    context's synchronize waits for it; a wait for a completed record is over at once."""
    with ctx0:
        busy, waiting = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
        event = ok(cu.cuEventCreate(2))
        assert ctx0.sleep(busy, 0.2) == 0
        ok(cu.cuEventRecord(event, busy))
        for stream in (waiting, cu.CUstream(0)):
            ok(cu.cuStreamWaitEvent(stream, event, 0))
            assert code(cu.cuStreamQuery(stream)) == NOT_READY
        ok(cu.cuCtxSynchronize())
        assert code(cu.cuEventQuery(event)) == 0
        for stream in (waiting, cu.CUstream(0)):
            assert code(cu.cuStreamQuery(stream)) == 0
            ok(cu.cuStreamWaitEvent(stream, event, 0))
            assert code(cu.cuStreamQuery(stream)) == 0
        ok(cu.cuEventDestroy(event))
        ok(cu.cuStreamDestroy(busy))
        ok(cu.cuStreamDestroy(waiting))
    assert take_violations()[0] == 0


def test_copies_move_their_bytes_when_they_complete(ctx0: Context) -> None:
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        src = ok(cu.cuMemHostAlloc(16, 1))
        dst = ok(cu.cuMemHostAlloc(16, 1))
        dev = ok(cu.cuMemAllocAsync(16, stream))
        ctypes.memset(src, 7, 16)
        assert ctx0.sleep(stream, 0.05) == 0
        ok(cu.cuMemcpyHtoDAsync(dev, src, 16, stream))
        ok(cu.cuMemcpyDtoHAsync(dst, dev, 16, stream))
        assert ctypes.string_at(dst, 16) == bytes(16)  # not at the call
        assert code(cu.cuStreamQuery(stream)) == NOT_READY
        ok(cu.cuStreamSynchronize(stream))
        assert ctypes.string_at(dst, 16) == bytes([7] * 16)
        ok(cu.cuMemFreeAsync(dev, stream))
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuMemFreeHost(src))
        ok(cu.cuMemFreeHost(dst))
        ok(cu.cuStreamDestroy(stream))
    assert take_violations()[0] == 0


@pytest.mark.parametrize("flags", [0, 1, 2])
def test_a_value_written_without_a_barrier_may_be_seen_before_the_work_before_it(
    ctx0: Context, flags: int
) -> None:
    """``cuStreamWriteValue32`` takes ``CU_STREAM_WRITE_VALUE_DEFAULT`` (0), whose memory
    barrier makes the work before it visible first, or ``..._NO_MEMORY_BARRIER`` (1), which
    "permits the write to be reordered with writes issued before it": here its value is seen
    while the copy before it has moved nothing and the stream is busy. Any other flag is
    CUDA_ERROR_INVALID_VALUE, and a violation."""
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
        if flags == 2:
            assert result == INVALID_VALUE
        else:
            assert result == 0
            deadline = time.monotonic() + 5
            while seen.value != 5 and time.monotonic() < deadline:
                time.sleep(0.0002)
            assert seen.value == 5, "waited 5 s in vain for the value to land"
            before = ctypes.string_at(dst, 16), code(cu.cuStreamQuery(stream))
            if flags == 1:
                assert before == (bytes(16), NOT_READY)
            else:
                assert before[0] == bytes([7] * 16)
        ok(cu.cuMemFreeAsync(dev, stream))
        ok(cu.cuStreamSynchronize(stream))
        assert ctypes.string_at(dst, 16) == bytes([7] * 16)
        for p in (src, dst, flag):
            ok(cu.cuMemFreeHost(p))
        ok(cu.cuStreamDestroy(stream))
    n, log = take_violations()
    assert n == (flags == 2), log
    assert flags != 2 or "cuStreamWriteValue32 with flags 0x2" in log, log


def test_freeing_memory_that_pending_work_uses_is_reported(ctx0: Context) -> None:
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
    n, log = take_violations()
    assert "cuMemFreeHost of pinned memory that 1 pending copies still use" in log
    assert "cuMemFreeAsync freed device memory that 1 pending operation(s) still use" in log
    assert n == 3, log  # and the copy itself then ran on freed memory


def test_a_stream_ordered_allocation_is_used_elsewhere_only_after_it(ctx0: Context) -> None:
    with ctx0:
        alloc, other = ok(cu.cuStreamCreate(1)), ok(cu.cuStreamCreate(1))
        host = ok(cu.cuMemHostAlloc(16, 1))
        assert ctx0.sleep(alloc, 0.02) == 0
        unordered = ok(cu.cuMemAllocAsync(16, alloc))
        ok(cu.cuMemcpyHtoDAsync(unordered, host, 16, other))
        ok(cu.cuStreamSynchronize(other))
        n, log = take_violations()
        assert n == 1 and "before the allocation completed" in log
        assert ctx0.sleep(alloc, 0.02) == 0
        ordered = ok(cu.cuMemAllocAsync(16, alloc))
        after = ok(cu.cuEventCreate(2))
        ok(cu.cuEventRecord(after, alloc))
        ok(cu.cuStreamWaitEvent(other, after, 0))
        ok(cu.cuMemcpyHtoDAsync(ordered, host, 16, other))
        ok(cu.cuCtxSynchronize())
        assert take_violations()[0] == 0
        for ptr in (unordered, ordered):
            ok(cu.cuMemFreeAsync(ptr, alloc))
        ok(cu.cuCtxSynchronize())
        ok(cu.cuMemFreeHost(host))
        ok(cu.cuEventDestroy(after))
        for s in (alloc, other):
            ok(cu.cuStreamDestroy(s))


def test_pinned_memory_of_another_context_needs_to_be_portable() -> None:
    if devices() < 2:
        pytest.skip("needs two devices")
    take_violations()
    a, b = Context(0), Context(1)
    with a:
        plain = ok(cu.cuMemHostAlloc(16, 0))
        portable = ok(cu.cuMemHostAlloc(16, 1))  # CU_MEMHOSTALLOC_PORTABLE
    with b:
        stream = ok(cu.cuStreamCreate(1))
        dev = ok(cu.cuMemAlloc(16))
        ok(cu.cuMemcpyHtoDAsync(dev, portable, 16, stream))
        assert take_violations()[0] == 0
        ok(cu.cuMemcpyHtoDAsync(dev, plain, 16, stream))
        ok(cu.cuStreamSynchronize(stream))
        n, log = take_violations()
        assert n == 1 and "without CU_MEMHOSTALLOC_PORTABLE" in log
        ok(cu.cuMemFree(dev))
        ok(cu.cuStreamDestroy(stream))
    with a:
        ok(cu.cuMemFreeHost(plain))
        ok(cu.cuMemFreeHost(portable))
    a.release()
    b.release()


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
    assert take_violations()[0] == 0


def test_a_host_function_that_runs_python_is_reported(ctx0: Context) -> None:
    """cuda-python's own cuLaunchHostFunc launches a wrapper that takes the GIL on the driver's
    thread, whatever function it is given: the stand-in refuses it as Python."""
    sem = ctypes.create_string_buffer(64)
    libc.sem_init(sem, 0, 0)
    post = cu.CUhostFn(ctypes.cast(libc.sem_post, ctypes.c_void_p).value)
    before = FAKE.fake_cuda_host_calls_python()
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        ok(cu.cuLaunchHostFunc(stream, post, ctypes.addressof(sem)))
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuStreamDestroy(stream))
    assert FAKE.fake_cuda_host_calls_python() == before + 1
    n, log = take_violations()
    assert n == 1 and "no C function of a loaded library" in log


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
    assert take_violations()[0] == 0


def test_kernel_launches_keep_the_device_limits(ctx0: Context) -> None:
    """cuLaunchKernel refuses a launch no device takes (CUDA_ERROR_INVALID_VALUE): a grid or
    block dimension of 0, more than 1024 threads a block, more than 48 KiB of dynamic shared
    memory; a launch it takes is recorded for the tests, grid, block and shared memory."""
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
        launch = (ctypes.c_uint * 7)()
        FAKE.fake_cuda_last_launch(launch)
        assert list(launch) == [2, 3, 4, 32, 32, 1, 48 * 1024]
        ok(cu.cuStreamSynchronize(stream))
        ok(cu.cuStreamDestroy(stream))
    assert take_violations()[0] == 0


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
    assert take_violations()[0] == 0


def test_priorities_are_recorded(ctx0: Context) -> None:
    with ctx0:
        stream = ok(cu.cuStreamCreateWithPriority(1, -3))
        assert FAKE.fake_cuda_stream_priority(int(stream)) == -3
        assert ok(cu.cuStreamGetPriority(stream)) == -3
        ok(cu.cuStreamDestroy(stream))
        # outside the range (-5 greatest, 0 least): clamped, as the driver documents
        least, greatest = ok(cu.cuCtxGetStreamPriorityRange())
        assert (least, greatest) == (0, -5)
        for asked, kept in ((-9, -5), (4, 0)):
            stream = ok(cu.cuStreamCreateWithPriority(1, asked))
            assert FAKE.fake_cuda_stream_priority(int(stream)) == kept
            assert ok(cu.cuStreamGetPriority(stream)) == kept
            ok(cu.cuStreamDestroy(stream))
    assert FAKE.fake_cuda_stream_priority(None) == -100


def test_event_flags_are_recorded(ctx0: Context) -> None:
    with ctx0:
        for flags in (0, 1, 2, 3, 6, 7):  # BLOCKING_SYNC 1, DISABLE_TIMING 2, INTERPROCESS 4
            event = ok(cu.cuEventCreate(flags))
            assert FAKE.fake_cuda_event_flags(int(event)) == flags
            ok(cu.cuEventDestroy(event))
        # interprocess needs timing disabled, as the driver documents
        assert code(cu.cuEventCreate(4)) == INVALID_VALUE
    assert FAKE.fake_cuda_event_flags(None) == -1


# ---------------------------------------------------------------------- in a process of its own


def _run(code_: str, **env: str) -> Any:
    return run_python("-c", PRELUDE + textwrap.dedent(code_), **env)


PRELUDE = """
import ctypes
from cuda.bindings import driver as cu
cu.cuInit(0)
ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1]
cu.cuCtxPushCurrent(ctx)
lib = ctypes.CDLL("libcuda.so.1")  # the stand-in's hooks
lib.fake_cuda_touch.argtypes = [
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint64
]
"""


def test_freed_pinned_memory_is_unmapped_and_touching_it_crashes() -> None:
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
        lib.fake_cuda_touch(0, int(stream), int(p), 16, 50_000_000)
        cu.cuEventRecord(event, stream)
        if {last_query!r} == "busy":
            assert int(cu.cuStreamQuery(stream)[0]) == 600
        if {last_query!r}.startswith("event"):
            assert int(cu.cuEventQuery(event)[0]) == 600
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
lib.fake_cuda_touch(1, int(other), int(dev), 16, 300_000_000)  # cuda:1 busy for 0.3 s
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
    proc = _run(USED_BY_ANOTHER + (seen if seen_busy else "") + "time.sleep(0.4)\n")
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
        print("live", lib.fake_cuda_live(0), lib.fake_cuda_live(3), flush=True)
        cu.cuCtxPushCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
        print("query", int(cu.cuStreamQuery(stream)[0]), flush=True)
        """
    )
    assert "live 0 0\nquery 400\n" in proc.stdout, proc.stdout + proc.stderr
    assert "2 handle(s) leaked at a context reset" in proc.stderr  # both were still alive
    assert "used after it was destroyed with its context" in proc.stderr
    assert proc.returncode == 70


def test_time_passes_for_device_work_as_it_does_on_a_gpu(ctx0: Context) -> None:
    with ctx0:
        stream = ok(cu.cuStreamCreate(1))
        start = time.perf_counter()
        assert ctx0.sleep(stream, 0.05) == 0
        assert code(cu.cuStreamQuery(stream)) == NOT_READY
        ok(cu.cuStreamSynchronize(stream))
        assert 0.045 <= time.perf_counter() - start < 1.0
        ok(cu.cuStreamDestroy(stream))
