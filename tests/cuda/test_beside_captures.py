"""aiostream beside other libraries' stream captures: a capture made by anyone, in any mode,
on another thread, is never broken by aiostream (neither by its own threads nor by the
queries it makes on the caller's), and aiostream's waits pending meanwhile complete as if
nothing happened.

The stand-in driver keeps the capture rules strictly (a potentially unsafe call in GLOBAL
mode while another thread's GLOBAL capture is under way invalidates it, and is counted as a
violation, which the ``contract`` fixture fails the test on); on a GPU the capture's end code
and graph say the same.
"""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from tests.helpers.capture import MODES, ForeignCapture
from tests.helpers.cuda import DEV, primary_context
from tests.helpers.deadlines import until
from tests.helpers.gate import gate
from tests.helpers.protocol import STRATEGIES

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_a_capture_on_another_thread_beside_100_pending_waits(
    anyio_backend: object, strategy: str, mode: str
) -> None:
    """100 waits pending on 10 streams (ten records a stream, behind a gate held past the
    capture) while another thread captures for 0.3 s: the capture ends with a graph that
    runs, and 100 of 100 waits complete, each after its own work, once the gates let it go."""
    ais.set_wait_strategy(strategy)
    streams = [ais.Stream(DEV) for _ in range(10)]
    events = []
    releases = []
    for s in streams:
        releases.append(gate(s))  # all 100 pend, however slowly a loaded machine runs
        for _ in range(10):
            ais.delay(0.001, stream=s)
            events.append(s.record_event())
    completed: list[ais.Event] = []

    async def wait(e: ais.Event) -> None:
        await e.synchronize()
        assert e.query()  # its work is done: the wait ended for it, not for a capture
        completed.append(e)

    try:
        async with anyio.create_task_group() as tg:
            for e in events:
                tg.start_soon(wait, e)
            await until(lambda: len(ais.pending_waits()) == 100, "the waits to be pending")
            with ForeignCapture(mode) as capture:
                await anyio.sleep(0.3)  # the watcher's looks and the loop's queries go on
                assert completed == []  # every wait still pends at the capture's end
            for release in releases:  # the work goes on now, after the capture's end
                release()
    finally:
        for release in releases:
            release()
    assert (capture.end_code, capture.refused) == (0, 0)
    assert capture.nodes == capture.captured >= 1 and capture.launched
    assert len(completed) == 100 and ais.pending_waits() == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_blocking_waits_and_queries_beside_a_global_capture(strategy: str) -> None:
    """A thread that synchronizes, queries and allocates through aiostream while another
    thread's GLOBAL capture is under way breaks nothing, and its thread's capture mode is
    what it was before."""
    from cuda.bindings import driver as cu

    ais.set_wait_strategy(strategy)
    s = ais.Stream(DEV)
    with ForeignCapture("global") as capture:
        ais.delay(0.02, stream=s)
        e = s.record_event()
        assert e.query() in (True, False) and s.query() in (True, False)
        e.synchronize_blocking()
        s.synchronize_blocking()
        buf = ais.DeviceBuffer(4096, DEV)
        host = ais.HostBuffer(4096, device=DEV)
        ais.copy_async(host, buf, stream=s)
        s.synchronize_blocking()
        del buf, host
        mode = cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode(0))
        assert int(mode[0]) == 0 and int(mode[1]) == 0  # GLOBAL, as the thread began
    assert (capture.end_code, capture.refused) == (0, 0) and capture.launched


# -------------------------------------------- a capture on a stream aiostream handed out


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
async def test_a_capture_on_a_handed_out_stream_gets_nothing_of_aiostreams(
    anyio_backend: object, mode: str
) -> None:
    """Another library captures on an aiostream stream's handle: an event recorded there is a
    captured event and the stream is capturing; awaiting, synchronizing or querying either
    raises an AiostreamError that says so, before any call that would break the capture;
    the graph holds the user's work only (no mark, flag write or host function of
    aiostream's), and once the capture ended the stream waits as before."""
    s = ais.Stream(DEV)
    ais.delay(0.01, stream=s)
    before = s.record_event()  # recorded before the capture: awaitable throughout
    with primary_context() as cu:  # the user's thread, its context current, captures
        handle = cu.CUstream(s.__cuda_stream__()[1])
        mode_ = cu.CUstreamCaptureMode(MODES[mode])
        assert int(cu.cuStreamBeginCapture(handle, mode_)[0]) == 0
        try:
            ais.delay(0.01, stream=s)  # a kernel node of the user's graph
            e = s.record_event()
            for refused in (s.query, e.query, s.synchronize_blocking, e.synchronize_blocking):
                with pytest.raises(ais.CaptureError, match="capturing a graph") as info:
                    refused()
                assert not isinstance(info.value, ais.DeviceError)  # the device is fine
            for awaited in (s, e):
                with pytest.raises(ais.CaptureError, match="capturing a graph"):
                    await awaited
            await before  # work from before the capture completes as usual
        finally:
            err, graph = cu.cuStreamEndCapture(handle)
        assert int(err) == 0, err  # not invalidated
        assert int(cu.cuGraphGetNodes(graph)[2]) == 1  # the user's kernel; none of aiostream's
        assert int(cu.cuGraphDestroy(graph)[0]) == 0
    with pytest.raises(ais.CaptureError, match="capturing a graph"):
        e.query()  # still a captured event: recorded in the capture, never run
    await s  # the capture ended: the stream waits as before
    s.record_event(e)  # recorded again outside a capture: an event like any other
    await e
    assert e.query()
