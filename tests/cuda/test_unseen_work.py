"""Work aiostream never sees, after an announced wait: the default stream, streams and events
handed out, events shared with other processes, and buffers shared or opened put work (or
records) where aiostream's own last wait said the stream was idle; each is complete only once
the driver says so, and waits follow the latest record.

Run where ``cuda:0`` works: on a GPU, and in CI's CUDA lane against the stand-in driver (which
lets a process open its own IPC handles: the tests that need that skip on a GPU).
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, device_finishes, primary_context
from tests.helpers.deadlines import until
from tests.helpers.faults import failing
from tests.helpers.gate import gated
from tests.helpers.process import in_spawned_process
from tests.helpers.stand_in import FAKE, hurry, take_violations

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]

#: the driver documents opening an IPC handle in another process only; the stand-in opens it
#: in its own, where both sides of these tests can be held and watched by one test
SAME_PROCESS_IPC = pytest.mark.stand_in("an IPC event handle opened in its own process")


# ---------------------------------------------------- the default stream


@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_the_default_stream_is_submitted_to_by_others_unseen(
    anyio_backend: object, strategy: str, own_backend: Any
) -> None:
    """The default stream (handle 0) is every library's, never aiostream's alone, even before
    its handle was handed out (a backend of the test's own: no earlier test handed it out):
    after an announced wait on it (hybrid's too: its work outlasts the loop's first
    millisecond, so the loop hands it over), work another library puts there unseen keeps it
    busy until the driver says it is done (not "idle because its last work was our host
    function")."""
    d = ais.default_stream(DEV)
    ais.delay(3600.0 if FAKE is not None else 0.05, stream=d)  # ends when the test says
    calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
    finished: list[bool] = []

    async def wait() -> None:
        await d.synchronize(strategy=strategy)
        finished.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await until(
            lambda: own_backend.held(0)["watched"] or finished,
            "the watcher to have the wait (hybrid: after 1 ms)",
        )
        hurry()  # the work ends now (on a GPU, in its time)
    assert finished
    if FAKE is not None:
        assert FAKE.fake_cuda_host_calls() - calls == 1  # announced by its host function
    elsewhere = ais.Stream(DEV)
    ais.delay(0.2, stream=elsewhere)
    gate = elsewhere.record_event()
    with primary_context(0) as cu:  # another library's wait on the default stream
        result = cu.cuStreamWaitEvent(cu.CUstream(0), cu.CUevent(gate.event_id), 0)
    assert result == (cu.CUresult.CUDA_SUCCESS,)
    assert not d.query()
    with anyio.fail_after(5):
        await d.synchronize()
    assert d.query() and gate.query()
    device_finishes()  # the announced wait's mark lands before the close


# ------------------------------------------------ events recorded unseen


async def test_elapsed_time_that_waits_out_a_host_function_checks_that_wait(
    anyio_backend: object,
) -> None:
    """``elapsed_time`` on an event recorded right after an announced wait, complete but
    for the host function before it, still returning (the driver answers
    ``CUDA_ERROR_NOT_READY``, injected here at the bindings), waits for it in the driver
    (``cuEventSynchronize``); where that call fails, the error names it, its device and
    code."""
    s = ais.Stream(DEV)
    start = ais.Event(DEV, enable_timing=True)
    start.record(s)
    ais.delay(0.3, stream=s)  # pending when the wait begins: it is announced, busy or not
    with anyio.fail_after(5):
        await s.record_event().synchronize(strategy="callback")
    end = s.record_event(ais.Event(DEV, enable_timing=True))
    with anyio.fail_after(5):
        await end.synchronize()
    with failing("cuEventElapsedTime", code=600), failing("cuEventSynchronize") as fault:
        with pytest.raises(ais.CudaError) as info:
            start.elapsed_time(end)
    assert fault.failed
    assert str(info.value).startswith(
        "cuEventSynchronize failed on cuda:0: CUDA_ERROR_UNKNOWN (999): unknown error"
    ), info.value
    assert start.elapsed_time(end) >= 0.0


async def test_a_free_after_the_users_work_leaves_the_stream_busy(
    anyio_backend: object,
) -> None:
    """A buffer freed on its stream (``cuMemFreeAsync``) after an announced wait and the
    user's later work: the stream is busy until that work completes, the free being
    submitted work too."""
    s = ais.Stream(DEV)
    with ais.use_stream(s):
        buf = ais.DeviceBuffer(1 << 10, DEV)  # allocated on s, used there only
    ais.delay(0.001, stream=s)
    with anyio.fail_after(5):
        await s.synchronize(strategy="callback")
    ais.delay(0.2, stream=s)
    del buf
    gc.collect()
    assert not s.query()
    with anyio.fail_after(5):
        await s.synchronize()
    assert s.query()


async def test_an_event_handed_out_may_be_recorded_unseen(
    anyio_backend: object,
) -> None:
    """Once an event's handle is handed out (``event_id``), others may record it unseen:
    recorded after an announced wait, it is complete only once the driver says so, and a wait
    on it follows that latest record."""
    s, elsewhere = ais.Stream(DEV), ais.Stream(DEV)
    e = ais.Event(DEV)
    ais.delay(0.001, stream=s)
    e.record(s)
    with anyio.fail_after(5):
        await e.synchronize(strategy="callback")
    other = ais.as_event(e.event_id, DEV)
    ais.delay(0.2, stream=elsewhere)
    other.record(elsewhere)  # the same CUDA event, recorded where e does not see
    assert not e.query()
    with anyio.fail_after(5):
        await e.synchronize()
    assert e.query() and other.query()


@SAME_PROCESS_IPC
async def test_an_opened_ipc_event_may_be_recorded_by_its_exporter_unseen(
    anyio_backend: object,
) -> None:
    """An event opened from an IPC handle is recorded by the process that exported it too,
    unseen: recorded here after an announced wait, then there, it is complete only once the
    driver says so. (Opened in its own process, the handle gives the exported event itself,
    shared: the driver opens handles in other processes only.)"""
    s, elsewhere = ais.Stream(DEV), ais.Stream(DEV)
    exported = ais.Event(DEV, interprocess=True)
    exported.record(s)
    opened = ais.Event.from_ipc_handle(DEV, exported.ipc_handle())
    ais.delay(0.02, stream=s)  # pending when the wait starts: its host function is launched
    opened.record(s)
    with anyio.fail_after(5):
        await opened.synchronize(strategy="callback")
    ais.delay(0.2, stream=elsewhere)
    exported.record(elsewhere)  # the exporter's record, which the opened event follows
    assert not opened.query()
    with anyio.fail_after(5):
        await opened.synchronize()  # it follows the exporter's latest record
    assert opened.query()


@SAME_PROCESS_IPC
async def test_an_exported_event_may_be_recorded_by_its_opener_unseen(
    anyio_backend: object,
) -> None:
    """Once its IPC handle is out, an event is recorded by the process that opens it too,
    unseen: recorded here after an announced wait, then there, it is complete only once the
    driver says so. (Opened in its own process, the handle gives the exported event itself,
    shared: a record of the opened event is one of the exported event.)"""
    s, elsewhere = ais.Stream(DEV), ais.Stream(DEV)
    exported = ais.Event(DEV, interprocess=True)
    ais.delay(0.02, stream=s)  # pending when the wait starts: its host function is launched
    exported.record(s)
    with anyio.fail_after(5):
        await exported.synchronize(strategy="callback")
    opened = ais.Event.from_ipc_handle(DEV, exported.ipc_handle())
    ais.delay(0.2, stream=elsewhere)
    opened.record(elsewhere)  # the opener's record: the exported event's
    assert not exported.query()
    with anyio.fail_after(5):
        await exported.synchronize()
    assert exported.query()


# -------------------------------------------------------- buffers shared


async def test_a_buffer_shared_after_an_announced_wait_leaves_its_stream_busy(
    anyio_backend: object,
) -> None:
    """Sharing a buffer (``ipc_handle``) makes the current stream wait, on the device, for the
    work of the buffer's other users: pending, it keeps that stream busy, though the stream's
    own last wait was announced."""
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    buf = ais.DeviceBuffer(64, DEV, interprocess=True)
    ais.delay(0.02, stream=s)  # pending when the wait starts: its host function launched
    with anyio.fail_after(5):
        await s.synchronize(strategy="callback")
    assert s.query()
    with gated(t):  # t's work ends when the test says
        ais.delay(0.001, stream=t)
        buf.record_stream(t)  # t's work so far uses the buffer
        with ais.use_stream(s):
            buf.ipc_handle()
        assert not s.query()
    with anyio.fail_after(5):
        await s.synchronize()


def _open_after_an_announced_wait(handle: bytes, out: Any) -> None:
    """In another process: open a shared buffer on a stream whose last wait was announced,
    then ask the stream while the driver says it is busy (this module, imported anew in the
    child, loaded the child's own driver as ``FAKE``)."""

    async def main() -> tuple[bool, bool]:
        s = ais.Stream(DEV)
        ais.delay(0.02, stream=s)  # pending when the wait starts: its host function launched
        with anyio.fail_after(5):
            await s.synchronize(strategy="callback")
        announced = s.query()
        with ais.use_stream(s):  # s waits for the exporter's event
            buf = ais.DeviceBuffer.from_ipc_handle(DEV, handle)
        # the stand-in's thread waited for the exporter's work here; a GPU's stream waits on
        # the device, busy till it completes, as cuStreamQuery says now (injected at the
        # bindings: the query must reach the driver)
        with failing("cuStreamQuery", code=600) as fault:  # CUDA_ERROR_NOT_READY
            busy = not s.query()
        busy = busy and fault.failed
        del buf
        return announced, busy

    try:
        announced, busy = anyio.run(main)
        gc.collect()
        out.put((announced, busy, take_violations() if FAKE is not None else (0, "")))
    except BaseException as exc:  # reported to the parent, which fails the test with it
        out.put((type(exc).__name__, str(exc), None))


def test_a_buffer_opened_after_an_announced_wait_leaves_the_stream_busy() -> None:
    """Opening another process's buffer puts a wait for its work on the current stream: the
    user's work, which an announced wait before it does not cover (the stream is busy until
    the driver says it is done)."""
    exported = ais.DeviceBuffer(64, DEV, interprocess=True)
    _, (announced, busy, violations) = in_spawned_process(
        _open_after_an_announced_wait, exported.ipc_handle()
    )
    assert violations is not None, f"{announced}: {busy}"
    assert violations[0] == 0, violations[1]
    assert announced is True and busy is True
