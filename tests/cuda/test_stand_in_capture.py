"""The stand-in driver models stream capture and graphs as the driver API reference and the
programming guide ("CUDA Graphs") describe them, strictly: work submitted to a capturing
stream becomes nodes of a graph that run at each launch; forks must be joined; waits that cross
a capture's boundary, prohibited calls (by the calling thread's capture interaction mode) and
calls that necessarily conflict with a capture are refused with the documented codes, and
invalidate the capture(s) they conflict with; each such refusal is a violation (rule
"capture"), so that a library breaking a capture, its own thread's or another's, is caught.

These talk to the driver through cuda-python's bindings directly (no aiostream), and run on every
driver: on a GPU they check that the stand-in models the real driver. The stand-in's own counts
(captures invalidated, graph nodes run) are read where its hooks are; the refusals it counts as
violations are taken where it is the driver (``tests/helpers/driver_calls.py``: on the stand-in
built without its hooks, the tests that provoke them run in a child process).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.driver_calls import (
    Context,
    Counter,
    Word,
    Worker,
    code,
    devices,
    ok,
    on_the_stand_in,
    provokes_violations,
    release_open_words,
    stand_in_only,
    take,
    violations,
)
from tests.helpers.process import run_python
from tests.helpers.stand_in import FAKE, OK, hurry

pytestmark = [pytest.mark.cuda]

if OK:  # a CUDA driver works: the stand-in's or a GPU's
    from cuda.bindings import driver as cu


GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2  # CUstreamCaptureMode
NONE, ACTIVE, INVALIDATED = 0, 1, 2  # CUstreamCaptureStatus
INVALID_VALUE, ILLEGAL_STATE, NOT_READY = 1, 401, 600
UNSUPPORTED, INVALIDATED_CODE, MERGE, UNMATCHED, UNJOINED = 900, 901, 902, 903, 904
ISOLATION, IMPLICIT, CAPTURED_EVENT, WRONG_THREAD = 905, 906, 907, 908
NON_BLOCKING, WAIT_EXTERNAL, PORTABLE, DEVICEMAP = 1, 1, 1, 2


def status(stream: Any) -> int:
    return int(ok(cu.cuStreamIsCapturing(stream)))


def assert_violations(n: int, *phrases: str) -> None:
    """The stand-in counted ``n`` violations saying ``phrases`` (taken); nothing on a GPU."""
    violations(n, *phrases)


def invalidated(n: int) -> None:
    """The stand-in counted ``n`` captures invalidated since the last read (its hook)."""
    if FAKE is not None:
        assert FAKE.fake_cuda_captures_invalidated() == n


@pytest.fixture
def ctx0() -> Iterator[Context]:
    take()
    if FAKE is not None:
        FAKE.fake_cuda_captures_invalidated()
        FAKE.fake_cuda_graph_nodes_run()
    c = Context(0)
    with c:
        yield c
    ok(cu.cuThreadExchangeStreamCaptureMode(GLOBAL))  # this thread's mode, as it was
    release_open_words()  # before the module's unload, which waits for all the device's work
    hurry()
    c.release()
    if FAKE is not None:
        FAKE.fake_cuda_clear_error()
        assert FAKE.fake_cuda_open_captures() == 0, "a test left a capture under way"


def streams(n: int, flags: int = NON_BLOCKING) -> list[Any]:
    return [ok(cu.cuStreamCreate(flags)) for _ in range(n)]


def destroy(*handles: Any) -> None:
    by_type = {cu.CUstream: cu.cuStreamDestroy, cu.CUevent: cu.cuEventDestroy}
    by_type |= {cu.CUgraphExec: cu.cuGraphExecDestroy, cu.CUgraph: cu.cuGraphDestroy}
    for h in handles:
        ok(by_type[type(h)](h))


def capture(stream: Any, mode: int = GLOBAL) -> None:
    ok(cu.cuStreamBeginCapture(stream, mode))


def end(stream: Any) -> Any:
    return ok(cu.cuStreamEndCapture(stream))


def end_failed(stream: Any, expected: int = INVALIDATED_CODE) -> None:
    """The capture ends with ``expected``, no graph, and its streams out of capture."""
    result = cu.cuStreamEndCapture(stream)
    assert code(result) == expected and int(result[1] or 0) == 0, result
    assert status(stream) == NONE


def node_count(graph: Any) -> int:
    return int(ok(cu.cuGraphGetNodes(graph))[1])


# ---------------------------------------------------------------------- capture and launch


def test_captured_work_runs_at_each_launch_and_not_at_capture(ctx0: Context) -> None:
    """A kernel, copies, a host function and a stream write captured: nothing runs at capture
    (the stream stays idle); each launch copies the bytes, calls the function, writes the
    value, and the launch is work of its stream, held behind a gate (a stream memory wait)
    until the test releases it."""
    (stream,) = streams(1)
    src, dst = ok(cu.cuMemHostAlloc(16, PORTABLE)), ok(cu.cuMemHostAlloc(16, PORTABLE))
    flag = ok(cu.cuMemHostAlloc(4, DEVICEMAP))
    dev = ok(cu.cuMemAlloc(16))
    counter = Counter()
    ctypes.memset(src, 7, 16)
    ctypes.memset(dst, 0, 16)
    ctypes.memset(flag, 0, 4)
    seen = ctypes.c_uint32.from_address(int(flag))
    capture(stream)
    assert status(stream) == ACTIVE
    assert ctx0.sleep(stream, 0.1) == 0
    ok(cu.cuMemcpyHtoDAsync(dev, src, 16, stream))
    ok(cu.cuMemcpyDtoHAsync(dst, dev, 16, stream))
    assert counter.launch(stream) == 0
    address = ok(cu.cuMemHostGetDevicePointer(flag, 0))
    ok(cu.cuStreamWriteValue32(stream, address, 5, 0))
    info = ok(cu.cuStreamGetCaptureInfo(stream))
    assert info[0] == ACTIVE and int(info[1]) > 0 and len(info[3]) == info[5] == 1
    graph = end(stream)
    assert int(info[2]) == int(graph)  # the graph being captured into is the one returned
    assert status(stream) == NONE and code(cu.cuStreamQuery(stream)) == 0
    assert (ctypes.string_at(dst, 16), counter.runs, seen.value) == (bytes(16), 0, 0)
    assert node_count(graph) == 5
    exec_ = ok(cu.cuGraphInstantiate(graph, 0))
    gate = Word()
    for launch, fill in enumerate((7, 9), start=1):
        ctypes.memset(src, fill, 16)
        ctypes.memset(dst, 0, 16)
        seen.value = gate.value = 0
        gate.hold(stream)
        start = time.perf_counter()
        ok(cu.cuGraphLaunch(exec_, stream))
        time.sleep(0.01)
        assert code(cu.cuStreamQuery(stream)) == NOT_READY
        assert (ctypes.string_at(dst, 16), counter.runs, seen.value) == (bytes(16), launch - 1, 0)
        gate.release()
        ok(cu.cuStreamSynchronize(stream))
        if on_the_stand_in():  # its sleep kernel node ran first (on a GPU it returns at once)
            assert time.perf_counter() - start >= 0.095
        assert ctypes.string_at(dst, 16) == bytes([fill] * 16)
        assert (counter.runs, seen.value) == (launch, 5)
    if FAKE is not None:
        assert FAKE.fake_cuda_graph_nodes_run() == 10
    destroy(exec_, graph, stream)
    gate.free()
    ok(cu.cuMemFree(dev))
    for p in (src, dst, flag):
        ok(cu.cuMemFreeHost(p))
    assert_violations(0)


def test_a_launch_is_ordered_after_the_streams_work_and_its_previous_launch(ctx0: Context) -> None:
    """Work after a launch (an event record) completes after all its nodes; a second launch on
    another stream is ordered behind the first ("any previous launches of hGraphExec"), which
    waits for b's earlier work (here a gate)."""
    a, b, c = streams(3)
    event = ok(cu.cuEventCreate(0))
    capture(a)
    assert ctx0.sleep(a, 0.05) == 0
    graph = end(a)
    exec_ = ok(cu.cuGraphInstantiate(graph, 0))
    gate = Word().hold(b)
    ok(cu.cuGraphLaunch(exec_, b))  # behind b's gate
    ok(cu.cuGraphLaunch(exec_, c))  # behind the launch on b
    ok(cu.cuEventRecord(event, c))
    time.sleep(0.02)
    assert code(cu.cuEventQuery(event)) == NOT_READY
    start = time.perf_counter()
    gate.release()
    ok(cu.cuEventSynchronize(event))
    if on_the_stand_in():  # its sleep kernel, once a launch (on a GPU it returns at once)
        assert time.perf_counter() - start >= 0.095
    destroy(exec_, graph, event, a, b, c)
    gate.free()
    assert_violations(0)


@provokes_violations
def test_an_executable_graph_destroyed_in_flight_completes_its_launch(ctx0: Context) -> None:
    """cuGraphExecDestroy of a launch in flight frees it "asynchronously on completion"; a
    graph destroyed while it has an executable graph leaves that one whole."""
    (stream,) = streams(1)
    src, dst = ok(cu.cuMemHostAlloc(16, PORTABLE)), ok(cu.cuMemHostAlloc(16, PORTABLE))
    dev = ok(cu.cuMemAlloc(16))
    ctypes.memset(src, 3, 16)
    ctypes.memset(dst, 0, 16)
    capture(stream)
    assert ctx0.sleep(stream, 0.0) == 0
    ok(cu.cuMemcpyHtoDAsync(dev, src, 16, stream))
    ok(cu.cuMemcpyDtoHAsync(dst, dev, 16, stream))
    graph = end(stream)
    exec_ = ok(cu.cuGraphInstantiate(graph, 0))
    ok(cu.cuGraphDestroy(graph))  # the executable graph keeps its nodes
    gate = Word().hold(stream)
    ok(cu.cuGraphLaunch(exec_, stream))
    ok(cu.cuGraphExecDestroy(exec_))
    if FAKE is not None:
        assert FAKE.fake_cuda_graphs_live(1) == 0
    time.sleep(0.01)
    assert ctypes.string_at(dst, 16) == bytes(16)  # still in flight: held by the gate
    gate.release()
    ok(cu.cuStreamSynchronize(stream))
    assert ctypes.string_at(dst, 16) == bytes([3] * 16)
    if FAKE is not None:
        assert FAKE.fake_cuda_graph_nodes_run() == 3
    if on_the_stand_in():  # a destroyed handle's use, undefined on a GPU
        assert code(cu.cuGraphLaunch(exec_, stream)) != 0
        assert_violations(1, "executable graph used after it was destroyed")
    destroy(stream)
    gate.free()
    ok(cu.cuMemFree(dev))
    ok(cu.cuMemFreeHost(src))
    ok(cu.cuMemFreeHost(dst))


@provokes_violations
def test_stream_ordered_memory_in_a_graph_is_allocated_at_each_launch(ctx0: Context) -> None:
    """An allocation captured with its free runs again at each launch; one left unfreed fails
    the next launch (CUDA_ERROR_INVALID_VALUE, documented) unless the graph was instantiated
    with AUTO_FREE_ON_LAUNCH."""
    (stream,) = streams(1)
    src, dst = ok(cu.cuMemHostAlloc(16, PORTABLE)), ok(cu.cuMemHostAlloc(16, PORTABLE))
    buffers = FAKE.fake_cuda_live(4) if FAKE is not None else 0
    ctypes.memset(src, 4, 16)
    capture(stream)
    dev = ok(cu.cuMemAllocAsync(16, stream))
    ok(cu.cuMemcpyHtoDAsync(dev, src, 16, stream))
    ok(cu.cuMemcpyDtoHAsync(dst, dev, 16, stream))
    ok(cu.cuMemFreeAsync(dev, stream))
    freeing = end(stream)
    capture(stream)
    kept = ok(cu.cuMemAllocAsync(16, stream))
    ok(cu.cuMemcpyHtoDAsync(kept, src, 16, stream))
    keeping = end(stream)
    exec_ = ok(cu.cuGraphInstantiate(freeing, 0))
    assert code(cu.cuGraphInstantiate(freeing, 0)) == INVALID_VALUE  # one at a time
    assert_violations(1, "at most one at a time")
    for _ in range(2):
        ctypes.memset(dst, 0, 16)
        ok(cu.cuGraphLaunch(exec_, stream))
        ok(cu.cuStreamSynchronize(stream))
        assert ctypes.string_at(dst, 16) == bytes([4] * 16)
    strict = ok(cu.cuGraphInstantiate(keeping, 0))
    ok(cu.cuGraphLaunch(strict, stream))
    assert code(cu.cuGraphLaunch(strict, stream)) == INVALID_VALUE
    assert_violations(1, "previous launch allocated is unfreed")
    ok(cu.cuMemFreeAsync(kept, stream))  # freed outside the graph: it launches again
    ok(cu.cuGraphLaunch(strict, stream))
    ok(cu.cuMemFreeAsync(kept, stream))
    ok(cu.cuGraphExecDestroy(strict))
    auto = ok(cu.cuGraphInstantiate(keeping, 1))  # AUTO_FREE_ON_LAUNCH
    ok(cu.cuGraphLaunch(auto, stream))
    ok(cu.cuGraphLaunch(auto, stream))  # the previous launch's allocation freed first
    ok(cu.cuMemFreeAsync(kept, stream))
    ok(cu.cuStreamSynchronize(stream))
    destroy(exec_, auto, freeing, keeping, stream)
    if FAKE is not None:
        assert FAKE.fake_cuda_live(4) == buffers  # graph memory, freed, is no live buffer
    ok(cu.cuMemFreeHost(src))
    ok(cu.cuMemFreeHost(dst))
    assert_violations(0)


@provokes_violations
def test_a_launch_into_a_capturing_stream_or_another_context_is_refused(ctx0: Context) -> None:
    a, b = streams(2)
    capture(a)
    assert ctx0.sleep(a, 0.0) == 0
    graph = end(a)
    exec_ = ok(cu.cuGraphInstantiate(graph, 0))
    capture(b)
    assert code(cu.cuGraphLaunch(exec_, b)) == UNSUPPORTED
    assert status(b) == INVALIDATED
    end_failed(b)
    assert_violations(1, "cuGraphLaunch into a capturing stream")
    if devices() > 1:
        other = Context(1)
        with other:
            (s1,) = streams(1)
            assert code(cu.cuGraphLaunch(exec_, s1)) == INVALID_VALUE
            destroy(s1)
        other.release()
        assert_violations(1, "executable graph of cuda:0's context on a stream of cuda:1's")
    destroy(exec_, graph, a, b)


# ---------------------------------------------------------------------- forks and joins


@provokes_violations
def test_a_fork_joins_the_capture_and_must_be_joined_back(ctx0: Context) -> None:
    """A stream waiting for an event recorded in a capture joins it; its nodes depend on what
    the record captured; joined back into the origin, the capture ends with one graph and both
    streams leave capture. Records and waits inside a capture are edges, not nodes."""
    origin, side = streams(2)
    forked, joined = ok(cu.cuEventCreate(2)), ok(cu.cuEventCreate(2))
    src, dst = ok(cu.cuMemHostAlloc(16, PORTABLE)), ok(cu.cuMemHostAlloc(16, PORTABLE))
    dev = ok(cu.cuMemAlloc(16))
    ctypes.memset(src, 6, 16)
    ctypes.memset(dst, 0, 16)
    capture(origin)
    ok(cu.cuMemcpyHtoDAsync(dev, src, 16, origin))
    first = ok(cu.cuStreamGetCaptureInfo(origin))[3]
    ok(cu.cuEventRecord(forked, origin))
    ok(cu.cuStreamWaitEvent(side, forked, 0))
    assert status(side) == ACTIVE
    info = ok(cu.cuStreamGetCaptureInfo(side))
    assert int(info[1]) == int(ok(cu.cuStreamGetCaptureInfo(origin))[1])  # one sequence
    assert [int(n) for n in info[3]] == [int(n) for n in first]
    assert code(cu.cuStreamBeginCapture(side, GLOBAL)) == ILLEGAL_STATE  # capturing already
    assert_violations(1, "already capturing (joined by a fork)")
    ok(cu.cuMemcpyDtoHAsync(dst, dev, 16, side))
    ok(cu.cuEventRecord(joined, side))
    ok(cu.cuStreamWaitEvent(origin, joined, 0))
    graph = end(origin)
    assert (status(origin), status(side)) == (NONE, NONE)
    assert node_count(graph) == 2
    exec_ = ok(cu.cuGraphInstantiate(graph, 0))
    ok(cu.cuGraphLaunch(exec_, origin))
    ok(cu.cuStreamSynchronize(origin))
    assert ctypes.string_at(dst, 16) == bytes([6] * 16)
    destroy(exec_, graph, forked, joined, origin, side)
    ok(cu.cuMemFree(dev))
    ok(cu.cuMemFreeHost(src))
    ok(cu.cuMemFreeHost(dst))
    assert_violations(0)


@pytest.mark.parametrize("work", [True, False])
@provokes_violations
def test_a_fork_not_joined_back_fails_the_capture(ctx0: Context, work: bool) -> None:
    """cuStreamEndCapture with a forked stream not joined back into the origin:
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED, no graph, and every stream leaves capture; a fork
    that submitted nothing must be joined too (the least forgiving reading)."""
    origin, side = streams(2)
    forked = ok(cu.cuEventCreate(2))
    capture(origin)
    assert ctx0.sleep(origin, 0.0) == 0
    ok(cu.cuEventRecord(forked, origin))
    ok(cu.cuStreamWaitEvent(side, forked, 0))
    if work:
        assert ctx0.sleep(side, 0.0) == 0
    assert ctx0.sleep(origin, 0.0) == 0
    if not work and not on_the_stand_in():
        # the documentation leaves an idle fork open: a GPU's driver may end with a graph
        result = cu.cuStreamEndCapture(origin)
        assert code(result) in (0, UNJOINED), result
        assert (status(origin), status(side)) == (NONE, NONE)
        if code(result) == 0:
            destroy(result[1])
    else:
        end_failed(origin, UNJOINED)
        assert status(side) == NONE
        invalidated(1)
        assert_violations(1, "1 stream(s) of the capture not joined back")
    destroy(forked, origin, side)


@provokes_violations
def test_a_capture_ends_on_its_origin_only(ctx0: Context) -> None:
    """cuStreamEndCapture on a stream that joined: CUDA_ERROR_STREAM_CAPTURE_UNMATCHED (and the
    capture invalidated); on a stream not capturing: CUDA_ERROR_ILLEGAL_STATE."""
    origin, side, idle = streams(3)
    forked = ok(cu.cuEventCreate(2))
    capture(origin)
    ok(cu.cuEventRecord(forked, origin))
    ok(cu.cuStreamWaitEvent(side, forked, 0))
    assert code(cu.cuStreamEndCapture(side)) == UNMATCHED
    assert status(origin) == status(side) == INVALIDATED
    assert code(cu.cuStreamEndCapture(idle)) == ILLEGAL_STATE
    end_failed(origin)
    assert_violations(
        2, "not its origin: CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "on a stream not capturing"
    )
    destroy(forked, origin, side, idle)


@provokes_violations
def test_the_default_stream_and_a_capturing_stream_cannot_begin_a_capture(
    ctx0: Context,
) -> None:
    """Not the legacy stream (NULL, CU_STREAM_LEGACY), as documented; the stand-in refuses
    CU_STREAM_PER_THREAD too, its least forgiving reading (one default stream for both), which
    a GPU's driver need not share."""
    (stream,) = streams(1)
    for default in (0, 1, 2) if on_the_stand_in() else (0, 1):
        assert code(cu.cuStreamBeginCapture(cu.CUstream(default), GLOBAL)) == UNSUPPORTED
    capture(stream)
    assert code(cu.cuStreamBeginCapture(stream, GLOBAL)) == ILLEGAL_STATE
    assert code(cu.cuStreamBeginCapture(stream, 3)) == INVALID_VALUE  # no such mode
    assert status(stream) == ACTIVE  # none of this touched the capture
    destroy(end(stream), stream)
    assert_violations(
        5,
        "cuStreamBeginCapture on the default stream",
        "already capturing (its origin)",
        "with mode 3",
    )


# ---------------------------------------------------------------------- waits across captures


@provokes_violations
def test_a_wait_on_work_outside_the_capture_is_isolation(ctx0: Context) -> None:
    """A capturing stream waiting for an event recorded outside the capture:
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION and the capture invalidated; from then on its streams
    answer CUDA_ERROR_STREAM_CAPTURE_INVALIDATED until cuStreamEndCapture, which gives no
    graph."""
    stream, other = streams(2)
    outside, inside = ok(cu.cuEventCreate(2)), ok(cu.cuEventCreate(2))
    ok(cu.cuEventRecord(outside, other))
    capture(stream)
    ok(cu.cuEventRecord(inside, stream))
    assert code(cu.cuStreamWaitEvent(stream, outside, 0)) == ISOLATION
    assert_violations(1, "recorded outside the capture: CUDA_ERROR_STREAM_CAPTURE_ISOLATION")
    assert status(stream) == INVALIDATED
    assert ctx0.sleep(stream, 0.0) == INVALIDATED_CODE
    for result in (
        cu.cuEventRecord(outside, stream),
        cu.cuStreamQuery(stream),
        cu.cuEventQuery(inside),  # an event of the invalidated capture
        cu.cuStreamWaitEvent(other, inside, 0),
    ):
        assert code(result) == INVALIDATED_CODE
    end_failed(stream)
    invalidated(1)
    assert_violations(0)  # the consequences are no new breach
    capture(stream)  # the stream captures again
    destroy(end(stream), outside, inside, stream, other)


def test_an_external_wait_is_a_node_that_waits_at_each_launch(ctx0: Context) -> None:
    """``CU_EVENT_WAIT_EXTERNAL`` lets a capturing stream wait for an event recorded outside:
    an event wait node, which waits for the event's latest record at each launch."""
    stream, other = streams(2)
    event = ok(cu.cuEventCreate(2))
    flag = ok(cu.cuMemHostAlloc(4, DEVICEMAP))
    address = ok(cu.cuMemHostGetDevicePointer(flag, 0))
    seen = ctypes.c_uint32.from_address(int(flag))
    capture(stream)
    ok(cu.cuStreamWaitEvent(stream, event, WAIT_EXTERNAL))
    ok(cu.cuStreamWriteValue32(stream, address, 1, 0))
    graph = end(stream)
    assert node_count(graph) == 2
    exec_ = ok(cu.cuGraphInstantiate(graph, 0))
    gate = Word()
    for _ in range(2):
        seen.value = gate.value = 0
        gate.hold(other)  # the record behind it waits for the release
        assert ctx0.sleep(other, 0.0) == 0
        ok(cu.cuEventRecord(event, other))
        ok(cu.cuGraphLaunch(exec_, stream))
        time.sleep(0.02)
        assert (seen.value, code(cu.cuStreamQuery(stream))) == (0, NOT_READY)
        gate.release()  # the record completes, the launch goes on
        ok(cu.cuStreamSynchronize(stream))
        assert seen.value == 1
        ok(cu.cuStreamSynchronize(other))
    destroy(exec_, graph, event, stream, other)
    gate.free()
    ok(cu.cuMemFreeHost(flag))
    assert_violations(0)


@pytest.mark.parametrize("first", ["under way", "ended"])
@provokes_violations
def test_a_wait_across_two_captures_is_a_merge(ctx0: Context, first: str) -> None:
    """Waiting, in one capture, for an event captured in another (under way, or ended: the
    event is still that graph's): CUDA_ERROR_STREAM_CAPTURE_MERGE, both invalidated."""
    a, b = streams(2)
    event = ok(cu.cuEventCreate(2))
    capture(a)
    assert ctx0.sleep(a, 0.0) == 0
    ok(cu.cuEventRecord(event, a))
    graph = end(a) if first == "ended" else None
    capture(b)
    assert code(cu.cuStreamWaitEvent(b, event, 0)) == MERGE
    assert status(b) == INVALIDATED
    if graph is None:
        assert status(a) == INVALIDATED
        end_failed(a)
    end_failed(b)
    invalidated(1 if graph else 2)
    assert_violations(1, "on an event of another capture sequence")
    destroy(*([graph] if graph else []), event, a, b)


# ---------------------------------------------------------------------- captured events


@provokes_violations
def test_a_captured_event_stays_captured_until_recorded_outside(ctx0: Context) -> None:
    """An event recorded in a capture is a dependency, not a node: a launch does not record
    it, and after the capture ended it still cannot be queried, synchronized or waited for
    (CUDA_ERROR_CAPTURED_EVENT, in any mode) until it is recorded again outside a capture."""
    stream, other = streams(2)
    event = ok(cu.cuEventCreate(0))
    capture(stream)
    assert ctx0.sleep(stream, 0.0) == 0
    ok(cu.cuEventRecord(event, stream))
    graph = end(stream)
    exec_ = ok(cu.cuGraphInstantiate(graph, 0))
    ok(cu.cuGraphLaunch(exec_, stream))
    ok(cu.cuStreamSynchronize(stream))
    if FAKE is not None:
        assert FAKE.fake_cuda_graph_nodes_run() == 1  # the kernel, no record
    ok(cu.cuThreadExchangeStreamCaptureMode(RELAXED))
    for result in (
        cu.cuEventQuery(event),
        cu.cuEventSynchronize(event),
        cu.cuStreamWaitEvent(other, event, 0),
        cu.cuEventElapsedTime(event, event),
    ):
        assert code(result) == CAPTURED_EVENT
    assert_violations(
        4,
        "cuEventQuery of an event last recorded in a capturing stream (its "
        "capture has ended): CUDA_ERROR_CAPTURED_EVENT",
    )
    ok(cu.cuEventRecord(event, other))
    ok(cu.cuEventSynchronize(event))
    ok(cu.cuEventQuery(event))
    destroy(exec_, graph, event, stream, other)
    assert_violations(0)


# ---------------------------------------------------------------------- prohibited calls


@provokes_violations
def test_potentially_unsafe_calls_are_refused_during_the_threads_own_capture(
    ctx0: Context,
) -> None:
    """In GLOBAL (default) or THREAD_LOCAL mode, a thread with a capture under way (not begun
    RELAXED) is refused every potentially unsafe call: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    and its capture is invalidated. In a capture begun RELAXED, they are allowed."""
    stream, other = streams(2)
    event = ok(cu.cuEventCreate(0))
    dev, host = ok(cu.cuMemAlloc(16)), ok(cu.cuMemHostAlloc(16, 0))
    buffer = ctypes.create_string_buffer(16)  # pageable memory
    pageable = ctypes.addressof(buffer)
    calls: dict[str, Callable[[], Any]] = {
        "cuEventQuery": lambda: cu.cuEventQuery(event),
        "cuEventSynchronize": lambda: cu.cuEventSynchronize(event),
        "cuStreamQuery": lambda: cu.cuStreamQuery(other),
        "cuStreamSynchronize": lambda: cu.cuStreamSynchronize(other),
        "cuCtxSynchronize": lambda: cu.cuCtxSynchronize(),
        "cuMemAlloc": lambda: cu.cuMemAlloc(16),
        "cuMemFree": lambda: cu.cuMemFree(dev),
        "cuMemHostAlloc": lambda: cu.cuMemHostAlloc(16, 0),
        "cuMemAllocHost": lambda: cu.cuMemAllocHost(16),
        "cuMemFreeHost": lambda: cu.cuMemFreeHost(host),
        "cuMemcpyDtoHAsync": lambda: cu.cuMemcpyDtoHAsync(pageable, dev, 16, other),
        "cuLaunchKernel": lambda: (ctx0.sleep(cu.CUstream(0), 0.0),),  # the legacy stream
    }
    for mode in (GLOBAL, THREAD_LOCAL):
        ok(cu.cuThreadExchangeStreamCaptureMode(mode))
        for name, call in calls.items():
            capture(stream)
            assert code(call()) == UNSUPPORTED, name
            end_failed(stream)
            assert_violations(1, name, "its capture is invalidated")
    ok(cu.cuThreadExchangeStreamCaptureMode(GLOBAL))
    capture(stream, RELAXED)
    ok(cu.cuEventQuery(event))
    ok(cu.cuStreamSynchronize(other))
    ok(cu.cuMemFreeHost(ok(cu.cuMemHostAlloc(16, 0))))
    destroy(end(stream), event, stream, other)
    ok(cu.cuMemFree(dev))
    ok(cu.cuMemFreeHost(host))
    assert_violations(0)


@provokes_violations
@pytest.mark.parametrize(
    ("capture_mode", "caller_mode", "refused"),
    [
        (GLOBAL, GLOBAL, True),
        (GLOBAL, THREAD_LOCAL, False),
        (GLOBAL, RELAXED, False),
        (THREAD_LOCAL, GLOBAL, False),
        (RELAXED, GLOBAL, False),
    ],
)
def test_another_threads_global_capture_prohibits_unsafe_calls_in_global_mode(
    ctx0: Context, capture_mode: int, caller_mode: int, refused: bool
) -> None:
    """A thread in GLOBAL mode is prohibited from potentially unsafe calls while another thread
    has a capture begun in GLOBAL mode: its cuEventQuery returns
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates that capture, a violation (the other
    thread's capture broken). In THREAD_LOCAL or RELAXED mode, or against a capture not begun
    GLOBAL, the call is allowed."""
    (stream,) = streams(1)
    event = ok(cu.cuEventCreate(0))
    worker = Worker(ctx0)
    try:
        worker(lambda: capture(stream, capture_mode))
        assert ctx0.sleep(stream, 0.0) == 0  # work from any thread joins a capture
        ok(cu.cuThreadExchangeStreamCaptureMode(caller_mode))
        result = code(cu.cuEventQuery(event))
        assert result == (UNSUPPORTED if refused else 0)
        assert status(stream) == (INVALIDATED if refused else ACTIVE)
        ended = worker(lambda: cu.cuStreamEndCapture(stream))
    finally:
        worker.close()
    if refused:
        assert code(ended) == INVALIDATED_CODE
        assert_violations(
            1,
            "in GLOBAL mode while another thread's GLOBAL capture is under way",
            "it invalidated the capture of another thread",
        )
    else:
        destroy(ok(ended))
        assert_violations(0)
    destroy(event, stream)


@provokes_violations
def test_a_capture_is_ended_by_the_thread_that_began_it_unless_relaxed(ctx0: Context) -> None:
    (stream,) = streams(1)
    worker = Worker(ctx0)
    try:
        worker(lambda: capture(stream, GLOBAL))
        assert code(cu.cuStreamEndCapture(stream)) == WRONG_THREAD
        assert status(stream) == INVALIDATED
        assert code(worker(lambda: cu.cuStreamEndCapture(stream))) == INVALIDATED_CODE
        assert_violations(
            1, "begun in GLOBAL mode by another thread: CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"
        )
        worker(lambda: capture(stream, RELAXED))
        destroy(end(stream))  # any thread ends a relaxed capture
    finally:
        worker.close()
    destroy(stream)
    assert_violations(0)


@provokes_violations
def test_calls_that_necessarily_conflict_are_refused_in_relaxed_mode(ctx0: Context) -> None:
    """RELAXED mode allows potentially unsafe calls, not those that conflict with a capture
    whatever the mode: querying, synchronizing or destroying a capturing stream, synchronizing
    its context, querying an event recorded in the capture. Each invalidates the capture."""
    (stream,) = streams(1)
    event = ok(cu.cuEventCreate(0))
    ok(cu.cuThreadExchangeStreamCaptureMode(RELAXED))
    checks: list[tuple[str, Callable[[], Any], int]] = [
        ("cuStreamQuery", lambda: cu.cuStreamQuery(stream), UNSUPPORTED),
        ("cuStreamSynchronize", lambda: cu.cuStreamSynchronize(stream), UNSUPPORTED),
        ("cuStreamDestroy", lambda: cu.cuStreamDestroy(stream), UNSUPPORTED),
        ("cuCtxSynchronize", lambda: cu.cuCtxSynchronize(), UNSUPPORTED),
        ("cuEventQuery", lambda: cu.cuEventQuery(event), CAPTURED_EVENT),
        ("cuEventSynchronize", lambda: cu.cuEventSynchronize(event), CAPTURED_EVENT),
    ]
    for name, call, expected in checks:
        capture(stream, RELAXED)
        ok(cu.cuEventRecord(event, stream))
        assert code(call()) == expected, name
        end_failed(stream)
        assert_violations(1, name, "its capture is invalidated")
    invalidated(6)
    ok(cu.cuEventRecord(event, stream))  # recorded outside: an ordinary event again
    ok(cu.cuEventSynchronize(event))
    destroy(event, stream)
    assert_violations(0)


@provokes_violations
def test_the_legacy_stream_is_unusable_while_a_blocking_stream_captures(ctx0: Context) -> None:
    """While a blocking stream (not CU_STREAM_NON_BLOCKING) captures, work on the legacy stream
    would depend on it: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and the capture invalidated,
    whatever the mode. cuStreamIsCapturing on the legacy stream says so without invalidating.
    A non-blocking capture leaves the legacy stream to RELAXED threads."""
    (blocking,) = streams(1, flags=0)
    (non_blocking,) = streams(1)
    legacy = cu.CUstream(0)
    ok(cu.cuThreadExchangeStreamCaptureMode(RELAXED))
    capture(blocking, RELAXED)
    assert code(cu.cuStreamIsCapturing(legacy)) == IMPLICIT
    assert code(cu.cuStreamGetCaptureInfo(legacy)) == IMPLICIT
    assert status(blocking) == ACTIVE
    assert_violations(0)
    assert ctx0.sleep(legacy, 0.0) == IMPLICIT
    assert status(blocking) == INVALIDATED
    end_failed(blocking)
    assert_violations(
        1,
        "on the legacy default stream while a blocking stream of cuda:0 "
        "captures: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
    )
    capture(non_blocking, RELAXED)
    assert status(legacy) == NONE
    assert ctx0.sleep(legacy, 0.0) == 0
    ok(cu.cuStreamSynchronize(legacy))
    destroy(end(non_blocking), blocking, non_blocking)
    assert_violations(0)


@provokes_violations
def test_other_threads_captures_in_other_contexts_count_too(ctx0: Context) -> None:
    """The GLOBAL rule is the process's: a capture on cuda:1 prohibits cuda:0's unsafe calls
    to a GLOBAL thread."""
    if devices() < 2:
        pytest.skip("needs two devices")
    other = Context(1)
    with other:
        (s1,) = streams(1)
    worker = Worker(other)
    try:
        worker(lambda: capture(s1, GLOBAL))
        assert code(cu.cuMemAlloc(16)) == UNSUPPORTED
        assert code(worker(lambda: cu.cuStreamEndCapture(s1))) == INVALIDATED_CODE
    finally:
        worker.close()
    with other:
        destroy(s1)
    other.release()
    assert_violations(1, "cuMemAlloc", "it invalidated the capture of another thread")


RELAXABLE = """
from cuda.bindings import driver as cu
cu.cuInit(0)
device = cu.cuDeviceGet(0)[1]
cu.cuCtxPushCurrent(cu.cuDevicePrimaryCtxRetain(device)[1])
stream = cu.cuStreamCreate(1)[1]
assert cu.cuStreamBeginCapture(stream, 0) == (cu.CUresult.CUDA_SUCCESS,)
print("refused", int(cu.cuCtxSynchronize()[0]), flush=True)
print("ended", int(cu.cuStreamEndCapture(stream)[0]), flush=True)
cu.cuStreamDestroy(stream)
cu.cuCtxPopCurrent()
cu.cuDevicePrimaryCtxRelease(device)
"""


@pytest.mark.parametrize("relax", ["capture", ""])
def test_the_capture_rule_can_be_relaxed(relax: str) -> None:
    """FAKE_CUDA_RELAX=capture (set when the process starts; the hook fake_cuda_relax does it
    later): refusals and invalidations as before, but no violation counted, and the exit
    clean. Works on either build of the stand-in."""
    stand_in_only("its rule relaxed through FAKE_CUDA_RELAX")
    proc = run_python("-c", RELAXABLE, FAKE_CUDA_RELAX=relax)
    assert f"refused {UNSUPPORTED}\nended {INVALIDATED_CODE}\n" in proc.stdout, proc.stderr
    if relax:
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    else:
        assert proc.returncode == 70, proc.stderr
        assert "fake_cuda: at exit: 1 violation(s)" in proc.stderr, proc.stderr
        assert "cuCtxSynchronize" in proc.stderr, proc.stderr


def test_the_capture_modes_are_swapped_per_thread(ctx0: Context) -> None:
    assert ok(cu.cuThreadExchangeStreamCaptureMode(RELAXED)) == GLOBAL  # the default
    worker = Worker(ctx0)
    try:  # another thread has its own, GLOBAL to begin with
        assert int(worker(lambda: ok(cu.cuThreadExchangeStreamCaptureMode(THREAD_LOCAL)))) == 0
        assert int(worker(lambda: ok(cu.cuThreadExchangeStreamCaptureMode(GLOBAL)))) == 1
    finally:
        worker.close()
    assert ok(cu.cuThreadExchangeStreamCaptureMode(GLOBAL)) == RELAXED
    assert code(cu.cuThreadExchangeStreamCaptureMode(7)) == INVALID_VALUE
