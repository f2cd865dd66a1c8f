"""The CUDA backend, the basics: detection, streams and their priorities, other libraries'
streams and events, events and their timing, driver errors and sticky device failures, every
wait strategy, copies, the loader, and the names ``python -m aiostream info`` gives devices.

Run where ``cuda:0`` works: on a GPU, and in CI's CUDA lane against the stand-in driver
(``tests/fake_cuda``); without either, every test here skips and says why. Work held pending
is held by a gate (``tests/helpers/gate.py``) and the driver calls aiostream makes are seen
through a spy of the bindings (``tests/helpers/faults.py``), on any driver; the tests that
inject a fault only the stand-in can (a kernel failing on the device) skip on a real GPU.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais
from tests.helpers import gate as gates
from tests.helpers.cuda import device_finishes
from tests.helpers.deadlines import deadline, until, until_blocking
from tests.helpers.faults import calls, failing, succeeded
from tests.helpers.gate import gate, gated
from tests.helpers.protocol import ANNOUNCED, STRATEGIES, backend
from tests.helpers.stand_in import EVENTS, FAKE, MODULES, STREAMS, hurry

pytestmark = pytest.mark.cuda

DEV = "cuda:0"


@pytest.fixture
def fake() -> Iterator[Any]:
    yield FAKE
    FAKE.fake_cuda_clear_error()


@pytest.fixture(autouse=True)
def default_strategy() -> Iterator[None]:
    """The default wait strategy comes back after each test, and the gates it used go: each
    released (a test that left one held fails), and its word freed once the device passed it
    (a word left at exit is a leak the stand-in reports)."""
    yield
    ais.set_wait_strategy(None)
    left_held = gates.release_all()
    until_blocking(lambda: gates.sweep() == 0, "the device to pass the gates released")
    assert not left_held, f"the test left {left_held} gate(s) held: use gated(), or release"


# ---------------------------------------------------------------------- detection and streams


def test_cuda_is_available_but_not_the_default_in_tests() -> None:
    assert ais.is_available("cuda")
    assert ais.device_count("cuda") >= 1
    assert ais.device(DEV) == ais.Device("cuda", 0)


def test_each_device_keeps_to_its_own_work() -> None:
    if ais.device_count("cuda") < 2:
        pytest.skip("needs two CUDA devices")
    s0, s1 = ais.Stream(DEV), ais.Stream("cuda:1")
    with pytest.raises(ValueError, match="cannot record an event of cuda:0 on a stream of cuda:1"):
        ais.Event(DEV).record(s1)
    with gated(s1):  # still pending when queried
        ais.delay(0.001, stream=s1)
        e1 = s1.record_event()
        assert e1.device == ais.Device("cuda", 1) and not e1.query()
        assert s0.query()  # work on cuda:1 is not on cuda:0's streams
    e1.synchronize_blocking()
    assert ais.default_stream("cuda:1") != ais.default_stream(DEV)


def test_objects_of_two_backends_are_never_mixed() -> None:
    """A handle means something only to its own backend: a CUDA stream cannot wait for a
    virtual event, nor a virtual stream for a CUDA one."""
    cuda, virtual = ais.Stream(DEV), ais.Stream("virtual:0")
    with pytest.raises(ValueError) as caught:
        cuda.wait_event(virtual.record_event())
    assert (
        str(caught.value) == "Stream on cuda:0 and Event on virtual:0 belong to different backends"
    )
    with pytest.raises(ValueError) as caught:
        virtual.wait_stream(cuda)
    assert (
        str(caught.value) == "Stream on virtual:0 and Stream on cuda:0 belong to different backends"
    )


def test_priorities_are_checked_against_the_drivers_range() -> None:
    lowest, highest = backend("cuda").priority_range(0)
    s = ais.Stream(DEV, priority=highest)
    assert s.priority == highest
    with pytest.raises(ValueError, match=rf"between {highest} \(highest\) and {lowest}"):
        ais.Stream(DEV, priority=lowest + 1)


def test_priorities_reach_the_driver() -> None:
    """Each priority of the range is the stream's own in the driver (cuStreamGetPriority, through
    a wrapper of its handle), not only in aiostream's record of it."""
    lowest, highest = backend("cuda").priority_range(0)
    for priority in range(highest, lowest + 1):
        s = ais.Stream(DEV, priority=priority)
        assert s.priority == priority
        if FAKE is not None:
            assert FAKE.fake_cuda_stream_priority(s.stream_id) == priority
        assert ais.ExternalStream(s.stream_id, DEV).priority == priority
    default = ais.Stream(DEV)  # 0, the driver's default
    assert default.priority == ais.ExternalStream(default.stream_id, DEV).priority == 0


def test_delay_takes_one_thread_of_the_device() -> None:
    """``delay`` launches its sleep kernel as one block of one thread, with no shared memory:
    the least of the device a kernel can take, so that it delays its stream and little else."""
    s = ais.Stream(DEV)
    with calls("cuLaunchKernel") as made:
        ais.delay(0.001, stream=s)
    [(args, result)] = made["cuLaunchKernel"]
    assert int(result[0]) == 0
    # (f, grid x y z, block x y z, shared memory bytes, stream, parameters, extra)
    assert [int(n) for n in args[1:8]] == [1, 1, 1, 1, 1, 1, 0]
    if FAKE is not None:
        launch = (ctypes.c_uint * 7)()
        FAKE.fake_cuda_last_launch(launch)
        assert list(launch) == [1, 1, 1, 1, 1, 1, 0]
    s.synchronize_blocking()


def test_cuda_stream_protocol_and_external_streams() -> None:
    s = ais.Stream(DEV)
    version, handle = s.__cuda_stream__()
    assert (version, handle) == (0, s.stream_id) and handle != 0
    ext = ais.ExternalStream(handle, DEV)
    assert ext == s and isinstance(ext, ais.Stream)
    assert "ExternalStream" in repr(ext)
    del ext
    gc.collect()
    s.record_event()  # dropping the wrapper did not destroy the stream
    assert ais.ExternalStream(0, DEV) == ais.default_stream(DEV)
    # the default stream's handle is 0, the driver's NULL stream, as torch's default stream's
    # cuda_stream is: CU_STREAM_LEGACY (1) would name the legacy stream even where the
    # bindings make 0 the per-thread one
    assert ais.default_stream(DEV).__cuda_stream__() == (0, 0)
    with pytest.raises(TypeError, match="is not a CUDA stream"):
        ais.Stream("virtual:0").__cuda_stream__()
    with pytest.raises(TypeError) as caught:
        ais.ExternalStream("0x1234")  # type: ignore[arg-type]
    assert str(caught.value) == "stream_ptr must be an int (a CUstream handle), got '0x1234'"
    with pytest.raises(ValueError, match="device must be cuda:N"):
        ais.ExternalStream(handle, "virtual:0")


def test_an_external_stream_with_no_device_is_on_cuda_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the default device is: an ExternalStream wraps a CUDA stream."""
    monkeypatch.setenv("AIOSTREAM_DEVICE", "virtual:0")
    assert ais.device() == ais.Device("virtual", 0)
    s = ais.Stream(DEV)
    ext = ais.ExternalStream(s.stream_id)
    assert ext.device == ais.Device("cuda", 0) and ext == s


class _Proto:
    def __init__(self, value: object) -> None:
        self.value = value

    def __cuda_stream__(self) -> object:
        return self.value


class _TorchLikeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.device = type("device", (), {"index": 0})()


class _CupyLikeStream:
    def __init__(self, handle: int) -> None:
        self.ptr = handle
        self.device_id = 0


def test_as_stream_accepts_every_kind_of_stream() -> None:
    s = ais.Stream(DEV)
    handle = s.stream_id
    assert ais.as_stream(s) is s
    for obj in (_Proto((0, handle)), _TorchLikeStream(handle), _CupyLikeStream(handle), handle):
        wrapped = ais.as_stream(obj)
        assert wrapped == s and wrapped.device == ais.Device("cuda", 0)
    with pytest.raises(ValueError, match=r"must return \(0, handle\)"):
        ais.as_stream(_Proto((3, handle)))
    with pytest.raises(TypeError, match="as_stream"):
        ais.as_stream("stream")


async def test_awaiting_an_external_stream(anyio_backend: object) -> None:
    s = ais.Stream(DEV)
    ext = ais.as_stream(_TorchLikeStream(s.stream_id))
    ais.delay(0.01, stream=s)
    done = s.record_event()
    await ext.synchronize(strategy="hybrid")
    # the stream is idle for the driver too: no host function of aiostream's is left on it,
    # even under the strategy that adds host functions
    assert done.query() and ext.query() and s.query()


async def test_work_submitted_through_a_wrapper_keeps_its_stream_busy(
    anyio_backend: object,
) -> None:
    """A stream of aiostream's whose handle was wrapped (``as_stream``, ``ExternalStream``) may
    get work aiostream never sees: its query asks the driver, whatever aiostream's own waits
    announced on it before."""
    for wrap in (ais.as_stream, lambda handle: ais.ExternalStream(handle, DEV)):
        s = ais.Stream(DEV)
        ais.delay(0.005, stream=s)
        await s.synchronize(strategy="callback")  # a host function announced its end
        wrapped = wrap(s.stream_id)
        ais.delay(0.3, stream=wrapped)  # work through the wrapper: s knows nothing of it
        assert not s.query()
        await s.synchronize()


# ---------------------------------------------------------------------- events


async def test_events_time_device_work(anyio_backend: object) -> None:
    s = ais.Stream(DEV)
    start, end = ais.Event(DEV, enable_timing=True), ais.Event(DEV, enable_timing=True)
    ais.delay(0.25, stream=s)  # what follows is queued behind it: timed on the device alone
    start.record(s)
    ais.delay(0.02, stream=s)
    end.record(s)
    await end.synchronize()
    # the 20 ms kernel between the records, to a fraction of a millisecond (the stand-in's
    # clock gives exactly 20.0); not the time since the records were made, nor the 0.25 s
    # before them
    assert 20.0 <= start.elapsed_time(end) < 20.5


def test_event_options_are_the_drivers_flags() -> None:
    """Each event option is the driver's flag the event is made with (``cuEventCreate``)."""
    s = ais.Stream(DEV)
    blocking, disable_timing, interprocess = 1, 2, 4  # CU_EVENT_*
    for kwargs, flags in (
        ({}, disable_timing),
        ({"enable_timing": True}, 0),
        ({"blocking": True}, blocking | disable_timing),
        ({"blocking": True, "enable_timing": True}, blocking),
        ({"interprocess": True}, interprocess | disable_timing),
    ):
        with calls("cuEventCreate") as made:
            e = ais.Event(DEV, **kwargs)
            e.record(s)
        made_with = [
            int(args[0])
            for args, result in made["cuEventCreate"]
            if int(result[0]) == 0 and int(result[1]) == e.event_id
        ]
        assert made_with == [flags], kwargs
        if FAKE is not None:
            assert FAKE.fake_cuda_event_flags(e.event_id) == flags, kwargs


async def test_blocking_events_are_awaited_like_any(anyio_backend: object) -> None:
    s = ais.Stream(DEV)
    e = ais.Event(DEV, blocking=True)
    ais.delay(0.01, stream=s)
    e.record(s)
    await e.synchronize()
    assert e.query()


async def test_as_event_wraps_a_foreign_event_without_owning_it(anyio_backend: object) -> None:
    owner = ais.Event(DEV)
    s = ais.Stream(DEV)
    owner.record(s)
    foreign = type("TorchLikeEvent", (), {"cuda_event": owner.event_id, "device": None})()
    wrapped = ais.as_event(foreign)
    assert wrapped.event_id == owner.event_id
    ais.delay(0.01, stream=s)
    wrapped.record(s)
    await wrapped.synchronize()
    del wrapped
    gc.collect()
    assert owner.query()  # still alive: the wrapper did not destroy it
    assert ais.as_event(owner) is owner
    with pytest.raises(ValueError, match="record it first"):
        ais.as_event(type("Unrecorded", (), {"cuda_event": 0})())
    with pytest.raises(TypeError, match="as_event"):
        ais.as_event(1.5)


def test_driver_errors_become_cuda_errors() -> None:
    s = ais.Stream(DEV)
    untimed = ais.Event(DEV)
    untimed.record(s)
    untimed.synchronize_blocking()
    wrapped = ais.as_event(untimed.event_id, DEV)  # its flags are unknown to the wrapper
    with pytest.raises(ais.CudaError) as info:
        wrapped.elapsed_time(wrapped)
    err = info.value
    assert isinstance(err, ais.DeviceError)
    assert err.code == 400 and err.name == "CUDA_ERROR_INVALID_HANDLE"
    assert err.device == DEV
    assert "cuEventElapsedTime" in str(err) and "CUDA_ERROR_INVALID_HANDLE" in str(err)


async def test_ipc_handles_round_trip(anyio_backend: object) -> None:
    s = ais.Stream(DEV)
    e = ais.Event(DEV, interprocess=True)
    with gated(s):  # pending however busy the machine: let go below
        ais.delay(0.001, stream=s)
        e.record(s)
        handle = e.ipc_handle()
        assert isinstance(handle, bytes) and len(handle) == 64
        opened = ais.Event.from_ipc_handle(DEV, handle)
        assert opened.query() is False
    await opened.synchronize()
    assert e.query()


@pytest.mark.parametrize("dropped_first", ["exported", "opened"])
def test_an_event_handle_opened_in_its_own_process_shares_the_event(dropped_first: str) -> None:
    """The driver documents opening an IPC handle in another process only (the stand-in
    refuses it in the exporting one, counting a violation): opened where it was made, a
    handle gives an Event sharing the exported one, with no driver call (a record of either
    is one of both), destroyed once both are dropped, in either order."""
    s = ais.Stream(DEV)
    live = FAKE.fake_cuda_live(EVENTS) if FAKE is not None else 0
    names = ("cuEventCreate", "cuIpcOpenEventHandle", "cuEventDestroy")
    with calls(*names) as made:
        exported = ais.Event(DEV, interprocess=True)
        opened = ais.Event.from_ipc_handle(DEV, exported.ipc_handle())
        handle = exported.event_id
        created = [int(r[1]) for _, r in made["cuEventCreate"] if int(r[0]) == 0]
        assert handle in created and made["cuIpcOpenEventHandle"] == []  # one event, shared
        if FAKE is not None:
            assert FAKE.fake_cuda_live(EVENTS) == live + 1
        assert opened.event_id == handle

        def destroyed() -> int:
            return sum(1 for args, r in made["cuEventDestroy"] if int(args[0]) == handle)

        with gated(s):  # pending however busy the machine: let go below
            ais.delay(0.001, stream=s)
            opened.record(s)
            assert not exported.query()
        exported.synchronize_blocking()
        assert opened.query()
        first, last = (exported, opened) if dropped_first == "exported" else (opened, exported)
        del exported, opened
        del first
        gc.collect()
        assert destroyed() == 0  # the other still uses it
        if FAKE is not None:
            assert FAKE.fake_cuda_live(EVENTS) == live + 1
        last.record(s)
        last.synchronize_blocking()
        del last
        gc.collect()
        assert destroyed() == 1 == succeeded(made["cuEventDestroy"][-1:])
    if FAKE is not None:
        assert FAKE.fake_cuda_live(EVENTS) == live


def test_bad_ipc_handles_are_refused_cleanly() -> None:
    with pytest.raises(ValueError, match="64 bytes"):
        ais.Event.from_ipc_handle(DEV, b"short")
    with pytest.raises(TypeError, match="handle must be bytes"):
        ais.Event.from_ipc_handle(DEV, "x" * 64)  # type: ignore[arg-type]
    with pytest.raises((ValueError, ais.CudaError)) as zeros:
        ais.Event.from_ipc_handle(DEV, b"\x00" * 64)
    if FAKE is not None:  # a driver refuses a handle it never gave with INVALID_VALUE
        assert zeros.type is ValueError and str(zeros.value) == (
            "the driver cannot open this event IPC handle (CUDA_ERROR_INVALID_VALUE): pass the "
            "64 bytes that Event.ipc_handle() returned in another process"
        )
        cause = zeros.value.__cause__
        assert isinstance(cause, ais.CudaError) and cause.name == "CUDA_ERROR_INVALID_VALUE"
        assert str(cause).startswith(
            f"cuIpcOpenEventHandle failed on {DEV}: CUDA_ERROR_INVALID_VALUE (1)"
        ), cause


@pytest.mark.stand_in("fault injection: a kernel that fails on the device")
async def test_device_failures_are_sticky_cuda_errors(anyio_backend: object, fake: Any) -> None:
    # what earlier tests dropped is freed now, while the device works (a free once it has
    # failed fails, and the backend says so at exit)
    hurry()
    device_finishes()
    ais.HostBuffer(1, device=DEV)
    s = ais.Stream(DEV)
    fake.fake_cuda_fail_next_launch(719)
    ais.delay(0.01, stream=s)
    e = s.record_event()
    # (no host function runs after a fault: the watcher's health check tells the waits)
    with anyio.fail_after(5), pytest.raises(ais.CudaError) as info:
        await e.synchronize()
    assert info.value.code == 719 and info.value.name == "CUDA_ERROR_LAUNCH_FAILED"
    assert info.value.device == DEV and f"failed on {DEV}: " in str(info.value)
    assert "unspecified launch failure" in str(info.value)
    with pytest.raises(ais.CudaError, match="CUDA_ERROR_LAUNCH_FAILED"):
        e.query()
    with anyio.fail_after(5), pytest.raises(ais.CudaError, match="CUDA_ERROR_LAUNCH_FAILED"):
        await ais.Stream(DEV).synchronize()
    # every query, wait and submission on the device: never True, never a hang
    for query in (s.query, ais.default_stream(DEV).query):
        with pytest.raises(ais.CudaError, match="cuStreamQuery failed.*LAUNCH_FAILED"):
            query()
    for submit in (
        lambda: ais.delay(0.001, stream=s),
        lambda: e.record(s),
        lambda: ais.copy_async(ais.HostBuffer(16, device=DEV), ais.HostBuffer(16, device=DEV)),
    ):
        with pytest.raises(ais.CudaError, match="LAUNCH_FAILED"):
            submit()
    for strategy in STRATEGIES:
        with anyio.fail_after(5), pytest.raises(ais.CudaError, match="LAUNCH_FAILED"):
            await e.synchronize(strategy=strategy)
    if ais.device_count("cuda") > 1:  # per device: another one works on
        other = ais.Stream("cuda:1")
        ais.delay(0.001, stream=other)
        await other.synchronize()
        assert other.query()


def test_query_raises_what_the_driver_reports() -> None:
    """Any answer of cuStreamQuery or cuEventQuery but done or not ready is raised as it is."""
    s = ais.Stream(DEV)  # nothing submitted: idle
    e = ais.Stream(DEV).record_event()
    e.synchronize_blocking()
    for name, query in (("cuStreamQuery", s.query), ("cuEventQuery", e.query)):
        with failing(name, code=999) as fault, pytest.raises(ais.CudaError) as info:
            query()
        assert fault.failed
        assert info.value.code == 999 and name in str(info.value)
        assert info.value.name == "CUDA_ERROR_UNKNOWN"
        assert query() is True  # the next answer is the driver's own again


# ---------------------------------------------------------------------- waiting strategies


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_every_strategy_waits_for_the_work(anyio_backend: object, strategy: str) -> None:
    s, other = ais.Stream(DEV), ais.Stream(DEV)
    host_calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
    python_calls = FAKE.fake_cuda_host_calls_python() if FAKE is not None else 0
    for i in range(10):  # back to back: each wait starts as the previous one's waiter closes
        ais.delay(0.002 * (i % 3), stream=s)
        e = s.record_event()
        ais.delay(0.001, stream=other)
        await e.synchronize(strategy=strategy)
        assert e.query()
        await other.synchronize(strategy=strategy)
        assert other.query()
    if FAKE is not None:
        launched = FAKE.fake_cuda_host_calls() - host_calls
        # A host function (sem_post) wakes the watcher for hybrid and callback waits; poll and
        # thread add nothing to the stream but the completion flag's write.
        assert (launched > 0) if strategy in ANNOUNCED else (launched == 0)
        # never Python on the driver's thread
        assert FAKE.fake_cuda_host_calls_python() == python_calls


async def test_the_global_strategy_applies_to_waits(anyio_backend: object) -> None:
    ais.set_wait_strategy("thread")
    s = ais.Stream(DEV)
    ais.delay(0.01, stream=s)
    await s.record_event().synchronize()
    assert s.query()


async def test_waits_on_many_streams_complete_in_any_order(anyio_backend: object) -> None:
    """Waits begun in one order end in the order their work completes, none held by another:
    the first wait's work does not end while the test runs (a gate holds it until the test
    lets it go), and the others', chained by events so that the last stream's work completes
    first, each with its own strategy, end meanwhile."""
    streams = [ais.Stream(DEV) for _ in range(5)]
    release = gate(streams[0])
    ais.delay(0.001, stream=streams[0])
    after = None
    for i in (4, 3, 2, 1):  # 4's work, then 3's after it, ...: the order is the device's
        if after is not None:
            streams[i].wait_event(after)
        ais.delay(0.005, stream=streams[i])
        after = streams[i].record_event()
    done: list[int] = []

    async def one(i: int, strategy: str) -> None:
        await streams[i].synchronize(strategy=strategy)
        done.append(i)

    try:
        async with anyio.create_task_group() as tg:
            for i, strategy in enumerate(STRATEGIES):  # five streams, one each
                tg.start_soon(one, i, strategy)
            await until(
                lambda: len(done) >= 4,
                "the waits on the four streams whose work ends to end",
                seconds=10,
            )
            assert sorted(done) == [1, 2, 3, 4]  # no wait blocked another
            assert not streams[0].query()  # all while the first one's work still runs
            release()  # its work ends now
    finally:
        release()
    assert done[4] == 0 and streams[0].query()


@pytest.mark.parametrize("strategy", ["thread", "hybrid"])
async def test_long_waits_cost_no_cpu(anyio_backend: object, strategy: str) -> None:
    s = ais.Stream(DEV)
    ais.delay(0.4, stream=s)
    e = s.record_event()
    cpu, wall = time.process_time(), time.perf_counter()
    await e.synchronize(strategy=strategy)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall >= 0.35
    assert cpu < 0.25 * wall, f"{strategy}: {cpu:.3f} s of CPU in a {wall:.3f} s wait"


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_cancelled_waits_leak_nothing(anyio_backend: object, strategy: str) -> None:
    # (slots of earlier tests' waits may never land: writes after a stand-in fault never run)
    start = backend("cuda").held(0)  # type: ignore[attr-defined]
    before = start["slots"]
    s = ais.Stream(DEV)
    ais.delay(0.1, stream=s)
    e = s.record_event()
    for _ in range(20):
        with anyio.move_on_after(0.002):
            await e.synchronize(strategy=strategy)
    assert ais.pending_waits() == []
    held = backend("cuda").held(0)  # type: ignore[attr-defined]
    assert held["watched"] == 0  # a cancelled wait is forgotten at once
    await e.synchronize(strategy=strategy)
    with deadline(2, "the watcher to free the slots whose values have landed"):
        while (held := backend("cuda").held(0))["slots"] > before:  # type: ignore[attr-defined]
            await anyio.sleep(0.01)
    assert held["watched"] == 0, held
    # no stream or marker per wait (the health event may be new)
    assert held["streams"] <= 1 and held["events"] <= start["events"] + 1, held


def test_late_wake_ups_after_the_loop_closed_are_harmless(monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[object] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    monkeypatch.setattr(sys, "unraisablehook", errors.append)

    async def leave_waits_behind() -> None:
        s = ais.Stream(DEV)
        ais.delay(0.1, stream=s)
        e = s.record_event()
        for strategy in ("thread", "callback"):
            with anyio.move_on_after(0.01):
                await e.synchronize(strategy=strategy)

    asyncio.run(leave_waits_behind())
    anyio.run(leave_waits_behind, backend="trio")
    time.sleep(0.25)  # the device work completes; threads and host functions wake closed loops
    assert errors == []


# ---------------------------------------------------------------------- memory and lifetimes


async def test_copies_round_trip_through_device_memory(anyio_backend: object) -> None:
    s = ais.Stream(DEV)
    data = np.arange(1024, dtype=np.float32)
    up, down = ais.HostBuffer(data.nbytes, device=DEV), ais.HostBuffer(data.nbytes, device=DEV)
    up.numpy(np.float32)[:] = data
    with ais.use_stream(s):  # allocated in order with the stream's work
        dev = ais.DeviceBuffer(data.nbytes, DEV)
    assert dev.__cuda_array_interface__["data"][0] != 0
    assert dev.__cuda_array_interface__["stream"] == s.stream_id  # the allocation's stream
    assert ais.DeviceBuffer(8, DEV).__cuda_array_interface__["stream"] == 1  # legacy default
    ais.copy_async(dev, up, stream=s)
    ais.delay(0.005, stream=s)
    ais.copy_async(down, dev, stream=s)
    await s.synchronize()
    np.testing.assert_array_equal(down.numpy(np.float32), data)


def test_handles_dropped_in_other_threads_are_released_once() -> None:
    """Streams and events dropped in another thread are destroyed there, each once, as the
    driver is asked (``cuStreamDestroy``, ``cuEventDestroy``). (The stand-in's counts of live
    handles agree: events counted are the user's, since a stream dropped with work pending
    leaves an internal marker behind until that work completes.)"""

    def events() -> int:
        internal: int = backend("cuda").held(0)["events"]  # type: ignore[attr-defined]
        return int(FAKE.fake_cuda_live(EVENTS)) - internal

    def handles(made: list[tuple[tuple[Any, ...], tuple[Any, ...]]]) -> list[int]:
        return [int(result[1]) for _, result in made if int(result[0]) == 0]

    gc.collect()
    if FAKE is not None:
        streams_before, events_before = FAKE.fake_cuda_live(STREAMS), events()
    with calls("cuStreamCreate", "cuStreamCreateWithPriority") as made:
        objs: list[object] = [ais.Stream(DEV) for _ in range(10)]
    streams = handles(made["cuStreamCreate"]) + handles(made["cuStreamCreateWithPriority"])
    with calls("cuEventCreate") as made:
        objs += [stream.record_event() for stream in objs]  # type: ignore[attr-defined]
    user_events = handles(made["cuEventCreate"])
    assert len(streams) == len(user_events) == 10
    if FAKE is not None:
        assert FAKE.fake_cuda_live(STREAMS) == streams_before + 10
        assert events() == events_before + 10

    def drop() -> None:
        objs.clear()
        gc.collect()

    with calls("cuStreamDestroy", "cuEventDestroy") as gone:
        t = threading.Thread(target=drop)
        t.start()
        t.join()
    for name, created in (("cuStreamDestroy", streams), ("cuEventDestroy", user_events)):
        destroyed = [int(args[0]) for args, result in gone[name] if int(result[0]) == 0]
        assert sorted(destroyed) == sorted(created), name  # each once, and all with success
    if FAKE is not None:
        assert FAKE.fake_cuda_live(STREAMS) == streams_before
        assert events() == events_before
        assert FAKE.fake_cuda_violations() == 0


def test_the_sleep_kernel_is_loaded_once(own_backend: Any) -> None:
    """A backend loads the module of ``delay``'s kernel at its first delay, and only then
    (``cuModuleLoadData``, as the driver is asked), and keeps it while it lives."""
    with calls("cuModuleLoadData", "cuModuleUnload") as made:
        s = ais.Stream(DEV)
        ais.delay(0.0, stream=s)
        assert succeeded(made["cuModuleLoadData"]) == 1
        loaded = FAKE.fake_cuda_live(MODULES) if FAKE is not None else 0
        for _ in range(3):
            ais.delay(0.0, stream=s)
        s.synchronize_blocking()
    assert len(made["cuModuleLoadData"]) == 1 and made["cuModuleUnload"] == []
    if FAKE is not None:
        assert FAKE.fake_cuda_live(MODULES) == loaded


async def test_the_loader_delivers_every_batch_intact(anyio_backend: object) -> None:
    async def source():  # type: ignore[no-untyped-def]
        for i in range(8):
            yield np.full(256, i, dtype=np.float32)

    out = ais.HostBuffer(1024, device=DEV)
    seen = []
    async with ais.DataLoader(source(), device=DEV, prefetch=2) as loader:
        async for batch in loader:
            ais.copy_async(out, batch.data)  # on the current stream, which waits for the batch
            await ais.current_stream(DEV).synchronize()
            seen.append(float(out.numpy(np.float32).mean()))
    assert seen == [float(i) for i in range(8)]
    assert loader.stats.peak_in_use <= 2 + 2


# ---------------------------------------------------------------------- names, detection, copies


def test_info_names_each_device_as_the_driver_does() -> None:
    """``python -m aiostream info`` lists every device with the name the driver gives it: the
    text before the NUL that ends it in the driver's buffer, nothing of what follows."""
    from aiostream.__main__ import info

    cuda = backend("cuda")
    names = [cuda.device_name(i) for i in range(ais.device_count("cuda"))]
    for name in names:
        assert name and name.isprintable() and name == name.strip(), repr(name)
    if FAKE is not None:
        assert names == [f"aiostream fake GPU {i}" for i in range(len(names))]
    listed = ", ".join(f"cuda:{i} ({name})" for i, name in enumerate(names))
    assert f"device{'s' if len(names) != 1 else ''}: {listed}\n" in info()


async def test_pageable_host_buffers_and_device_to_device_copies_move_the_data(
    anyio_backend: object,
) -> None:
    """A pageable HostBuffer (``pinned=False``) is the memory its copies read and write, and a
    copy between two DeviceBuffers reads the source: host to device, device to device,
    device to host, every byte."""
    s = ais.Stream(DEV)
    data = np.arange(4096, dtype=np.uint8) * 7
    up = ais.HostBuffer(data.nbytes, pinned=False, device=DEV)
    down = ais.HostBuffer(data.nbytes, pinned=False, device=DEV)
    assert not up.pinned
    up.numpy()[:] = data
    with ais.use_stream(s):
        first, second = ais.DeviceBuffer(data.nbytes, DEV), ais.DeviceBuffer(data.nbytes, DEV)
    ais.copy_async(first, up, stream=s)
    ais.copy_async(second, first, stream=s)
    ais.copy_async(down, second, stream=s)
    await s.synchronize()
    np.testing.assert_array_equal(down.numpy(), data)
    assert ais.HostBuffer(0, pinned=False, device=DEV).nbytes == 0
