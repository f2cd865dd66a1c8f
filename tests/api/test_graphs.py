"""Graphs: capture a stream's work once, replay it as a whole; what a capture refuses, with the
same error and words on every backend (virtual devices and CUDA, on the stand-in driver in
CI), on every loop."""

from __future__ import annotations

import functools
import gc
import re
import threading
import weakref
from contextlib import AbstractContextManager

import anyio
import pytest

import aiostream as ais
from tests.helpers.deadlines import until
from tests.helpers.races import closed_while_called

pytestmark = pytest.mark.anyio

N = 1024
LONG = 0.3  # seconds of device work that is still pending after a few quick calls


def words(message: str) -> str:
    """A message with its stream's or event's id and device left out: what must read the
    same on every backend."""
    return re.sub(r"(stream|event) \d+ on \w+:\d+", r"\1 N on DEV", message)


def pipeline(dev: ais.Device) -> tuple[ais.HostBuffer, ais.HostBuffer, ais.DeviceBuffer]:
    return ais.HostBuffer(N, device=dev), ais.HostBuffer(N, device=dev), ais.DeviceBuffer(N, dev)


async def test_captured_work_runs_at_each_replay_and_not_at_capture(
    aiostream_device: ais.Device,
) -> None:
    """Copies in, a kernel, copies out, captured: nothing runs while capturing; each replay
    moves the bytes the host buffer holds then, and its event completes after all of it."""
    dev = aiostream_device
    src, dst, buf = pipeline(dev)
    g = ais.Graph(dev, name="echo")
    with g.capture() as s:
        assert ais.current_stream(dev) is s  # work with no stream goes to the capture
        ais.copy_async(buf, src)
        ais.delay(0.01, stream=ais.current_stream(dev))
        ais.copy_async(dst, buf)
    assert g.nodes == 3 and g.replays == 0
    await s  # it ran nothing: an idle stream
    assert not dst.numpy().any()
    r = ais.Stream(dev)
    for fill in (7, 9, 11):
        src.numpy()[:] = fill
        done = g.replay(r)
        assert isinstance(done, ais.Event)
        await done
        assert (dst.numpy() == fill).all()
    assert g.replays == 3
    g.close()


async def test_await_replay_waits_for_that_replay_only(aiostream_device: ais.Device) -> None:
    """Each replay's event is its own; the launches of one graph run one after the other, as
    CUDA orders the launches of an executable graph, whatever their streams."""
    dev = aiostream_device
    g = ais.Graph(dev)
    with g.capture() as s:
        ais.delay(0.02, stream=s)
    slow, quick = ais.Stream(dev), ais.Stream(dev)
    first = g.replay(quick)
    ais.delay(LONG, stream=slow)
    behind = g.replay(slow)  # after the long kernel
    await first
    assert first.query() and not behind.query()
    after = g.replay(quick)  # after the previous launch: behind the long kernel too
    assert not after.query()
    await after
    assert behind.query() and slow.query()


async def test_a_fork_joined_back_is_captured_and_replayed(aiostream_device: ais.Device) -> None:
    """A stream that waits for an event recorded in the capture joins it; joined back, its
    work is part of the graph and of every replay."""
    dev = aiostream_device
    src, dst, buf = pipeline(dev)
    other = ais.Stream(dev)
    g = ais.Graph(dev)
    with g.capture() as s:
        ais.copy_async(buf, src, stream=s)
        other.wait_stream(s)  # a fork: other joins the capture here
        ais.delay(0.01, stream=other)
        ais.copy_async(dst, buf, stream=other)
        s.wait_stream(other)  # joined back
    assert g.nodes == 3
    await other  # nothing of the capture ran there
    src.numpy()[:] = 5
    await g.replay()
    assert (dst.numpy() == 5).all()


async def test_a_fork_left_unjoined_makes_no_graph(aiostream_device: ais.Device) -> None:
    dev = aiostream_device
    other = ais.Stream(dev)
    g = ais.Graph(dev, name="forked")
    with pytest.raises(ais.CaptureError) as caught:
        with g.capture() as s:
            ais.delay(0.01, stream=s)
            other.wait_stream(s)
            ais.delay(0.01, stream=other)
    assert words(str(caught.value)) == (
        "the capture of stream N on DEV ended with work forked to other streams and not joined "
        "back, so no graph was made: before the capture ends, make the capturing stream wait "
        "for each stream it forked to (capturing.wait_stream(other))"
    )
    await s  # both streams out of the capture, usable
    await other
    ais.delay(0.01, stream=other)
    await other
    with pytest.raises(ais.AiostreamError, match="the capture of graph 'forked' failed"):
        g.replay()


CAPTURING = (
    "stream N on DEV is capturing a graph: its work is recorded, not run, until the capture "
    "ends, so it cannot be awaited, synchronized or queried now; await an event recorded "
    "before the capture began, or the stream once the capture has ended"
)
CAPTURED = (
    "event N on DEV was recorded on a stream that was capturing a graph: it marks a point of "
    "the graph, not work that runs, so it cannot be awaited, synchronized, queried or timed; "
    "await the event Graph.replay() returns, or record this one again outside the capture"
)


async def test_what_a_capture_refuses_is_said_the_same_on_every_backend(
    aiostream_device: ais.Device,
) -> None:
    """Awaiting, synchronizing or querying the capturing stream or a captured event, a wait
    for an event recorded outside the capture: a CaptureError before the driver is asked, so
    the capture goes on and still makes its graph."""
    dev = aiostream_device
    outside = ais.Stream(dev).record_event()
    g = ais.Graph(dev)
    with g.capture() as s:
        ais.delay(0.01, stream=s)
        e = s.record_event(ais.Event(dev, enable_timing=True))
        refusals = [
            (s.query, CAPTURING),
            (s.synchronize_blocking, CAPTURING),
            (e.query, CAPTURED),
            (e.synchronize_blocking, CAPTURED),
            (lambda: e.elapsed_time(e), CAPTURED),
        ]
        for call, expected in refusals:
            with pytest.raises(ais.CaptureError) as caught:
                call()
            assert words(str(caught.value)) == expected
        for awaited, expected in ((s, CAPTURING), (e, CAPTURED)):
            with pytest.raises(ais.CaptureError) as caught:
                await awaited
            assert words(str(caught.value)) == expected
        with pytest.raises(ais.CaptureError) as caught:
            s.wait_event(outside)
        assert words(str(caught.value)) == (
            "stream N on DEV is capturing a graph and cannot wait for an event recorded "
            "outside the capture (the driver refuses it and breaks the capture): make the "
            "stream wait before the capture begins, or record the event inside it"
        )
        ais.delay(0.01, stream=s)
    assert g.nodes == 2  # the capture went on
    await g.replay()
    with pytest.raises(ais.CaptureError, match="capturing a graph"):
        e.query()  # still a captured event
    e.record(s)  # recorded outside a capture: an event like any other again
    await e


async def test_a_wait_for_another_captures_event_is_refused(aiostream_device: ais.Device) -> None:
    """Two captures under way at once: a stream of one cannot wait for an event recorded in
    the other (one graph cannot depend on another's capture); both still make their graphs."""
    dev = aiostream_device
    first, second = ais.Graph(dev), ais.Graph(dev)
    with first.capture() as a, second.capture() as b:
        ais.delay(0.01, stream=a)
        ais.delay(0.01, stream=b)
        theirs = a.record_event()
        with pytest.raises(ais.CaptureError) as caught:
            b.wait_event(theirs)
        assert words(str(caught.value)) == (
            "stream N on DEV cannot wait for an event recorded in another graph capture than "
            "its own: one graph cannot depend on another's capture; wait for an event of the "
            "same capture"
        )
    assert first.nodes == second.nodes == 1
    await first.replay()
    await second.replay()


async def test_an_event_of_an_ended_capture_is_waited_for_by_no_stream(
    aiostream_device: ais.Device,
) -> None:
    """Once its capture ended, an event recorded in it is a point of a graph: a stream asked
    to wait for it refuses (it would join a capture that is over) and stays as it was."""
    dev = aiostream_device
    g = ais.Graph(dev)
    with g.capture() as s:
        ais.delay(0.01, stream=s)
        e = s.record_event()
    other = ais.Stream(dev)
    with pytest.raises(ais.CaptureError) as caught:
        other.wait_event(e)
    assert words(str(caught.value)) == CAPTURED
    ais.delay(0.01, stream=other)  # runs: other is in no capture
    await other
    assert other.query()
    await g.replay()


async def test_a_forked_stream_dropped_during_the_capture_breaks_nothing(
    aiostream_device: ais.Device,
) -> None:
    dev = aiostream_device
    g = ais.Graph(dev)
    with g.capture() as s:
        side = ais.Stream(dev)
        side.wait_stream(s)
        ais.delay(0.01, stream=side)
        s.wait_stream(side)
        del side
        gc.collect()  # destroyed once the capture ends, not under it
        ais.delay(0.01, stream=s)
    assert g.nodes == 2
    await g.replay()


async def test_a_replays_event_recorded_again_keeps_its_buffers(
    aiostream_device: ais.Device,
) -> None:
    """The Event a replay returns is the program's: recorded elsewhere after, it no longer
    says when the replay ends, and closing the graph still keeps the buffers until then."""
    dev = aiostream_device
    src, dst, buf = pipeline(dev)
    refs = [weakref.ref(b) for b in (src, buf)]
    g = ais.Graph(dev)
    with g.capture() as s:
        ais.copy_async(buf, src, stream=s)
        ais.delay(LONG, stream=s)
        ais.copy_async(dst, buf, stream=s)
    del src, buf
    r = ais.Stream(dev)
    done = g.replay(r)
    done.record(ais.Stream(dev))  # complete at once: nothing on that stream
    g.close()
    gc.collect()
    assert all(ref() is not None for ref in refs)  # the replay still runs
    await r
    await until(
        lambda: (gc.collect(), all(ref() is None for ref in refs))[1],
        "the buffers to go once the replay completed",
    )


async def test_memory_is_not_allocated_during_a_capture(aiostream_device: ais.Device) -> None:
    """Not on the capturing thread unless the mode is relaxed, and not on a capturing stream
    in any mode; pageable host memory is not copied in a capture."""
    dev = aiostream_device
    g = ais.Graph(dev)
    with g.capture() as s:
        for allocate in (lambda: ais.HostBuffer(N, device=dev), lambda: ais.DeviceBuffer(N, dev)):
            with pytest.raises(ais.CaptureError) as caught:
                allocate()
            assert str(caught.value) == (
                "memory cannot be allocated on the thread of a graph capture in "
                "'thread_local' mode while the capture is under way (the driver prohibits it, "
                "and would break the capture): allocate buffers before the capture begins, or "
                "capture with capture_error_mode='relaxed'"
            )
        ais.delay(0.01, stream=s)
    relaxed = ais.Graph(dev)
    pageable = ais.HostBuffer(N, pinned=False, device=dev)
    device_buf = ais.DeviceBuffer(N, dev)
    with relaxed.capture(capture_error_mode="relaxed") as s:
        host = ais.HostBuffer(N, device=dev)  # allowed: the thread is not held to the rules
        with pytest.raises(ais.CaptureError) as caught:
            ais.DeviceBuffer(N, dev)  # on the current stream: the capturing one
        assert words(str(caught.value)) == (
            "memory cannot be allocated on stream N on DEV, which is capturing a graph (the "
            "allocation would become part of the graph): allocate buffers before the capture "
            "begins, or on a stream outside it"
        )
        with pytest.raises(ais.CaptureError) as caught:
            ais.copy_async(device_buf, pageable, stream=s)
        assert words(str(caught.value)) == (
            "a copy between pageable host memory and the device cannot be captured on stream N "
            "on DEV (the driver runs it synchronously): use a pinned HostBuffer (pinned=True, "
            "the default)"
        )
        ais.copy_async(device_buf, host, stream=s)
    assert relaxed.nodes == 1
    await relaxed.replay()


async def test_a_capture_left_by_an_exception_is_ended(aiostream_device: ais.Device) -> None:
    dev = aiostream_device
    g = ais.Graph(dev, name="broken")
    s = ais.Stream(dev)
    with pytest.raises(KeyError):
        with g.capture(s):
            ais.delay(0.01, stream=s)
            raise KeyError("the user's")
    assert s.query()  # out of the capture; the captured kernel never ran
    ais.delay(0.01, stream=s)
    await s
    with pytest.raises(ais.AiostreamError, match="the capture of graph 'broken' failed"):
        g.replay()
    again = ais.Graph(dev)  # the stream can be captured again
    with again.capture(s):
        ais.delay(0.01, stream=s)
    await again.replay()


async def test_the_buffers_of_a_graph_live_while_it_can_run(aiostream_device: ais.Device) -> None:
    """Dropped by the program, the buffers a graph's copies use live on while it is open, and
    after it is closed until its last replays completed."""
    dev = aiostream_device
    src, dst, buf = pipeline(dev)
    out = dst.numpy()
    refs = [weakref.ref(b) for b in (src, buf)]
    src.numpy()[:] = 3
    g = ais.Graph(dev)
    with g.capture() as s:
        ais.copy_async(buf, src, stream=s)
        ais.delay(0.01, stream=s)
        ais.copy_async(dst, buf, stream=s)
    del src, buf
    gc.collect()
    assert all(r() is not None for r in refs)
    await g.replay()
    assert (out == 3).all()
    slow = ais.Stream(dev)
    ais.delay(LONG, stream=slow)
    pending = g.replay(slow)
    g.close()  # a replay is pending: its buffers stay
    gc.collect()
    assert all(r() is not None for r in refs)
    with pytest.raises(ais.AiostreamError, match="was closed"):
        g.replay()
    await pending
    await until(
        lambda: (gc.collect(), all(r() is None for r in refs))[1],
        "the graph's buffers to go once its last replay completed",
    )


async def test_pending_waits_name_the_replay(aiostream_device: ais.Device) -> None:
    dev = aiostream_device
    g = ais.Graph(dev, name="decode")
    with g.capture() as s:
        ais.delay(LONG, stream=s)
    async with anyio.create_task_group() as tg:
        tg.start_soon(g.replay().synchronize)
        await until(lambda: ais.pending_waits() != [], "the replay's wait to be pending")
        (wait,) = ais.pending_waits()
        assert "replay 1 of graph 'decode'" in wait.subject


async def test_bad_input_is_refused_and_nothing_enqueued(aiostream_device: ais.Device) -> None:
    dev = aiostream_device
    g = ais.Graph(dev, name="g")
    with pytest.raises(ais.AiostreamError, match="has not been captured"):
        g.replay()
    with pytest.raises(TypeError, match="name must be a str"):
        ais.Graph(dev, name=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        with g.capture(stream=3):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="capture_error_mode must be a str"):
        with g.capture(capture_error_mode=1):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="capture_error_mode must be one of"):
        with g.capture(capture_error_mode="loose"):
            pass
    with pytest.raises(ais.CaptureError) as caught:
        with g.capture(ais.default_stream(dev)):
            pass
    assert str(caught.value) == (
        f"the default stream of {dev} cannot be captured (CUDA refuses its legacy default "
        "stream): capture a stream of your own (Graph.capture() with no stream makes one)"
    )
    s = ais.Stream(dev)
    with g.capture(s):
        with pytest.raises(ais.CaptureError) as caught:
            with ais.Graph(dev).capture(s):
                pass
        assert words(str(caught.value)) == (
            "stream N on DEV is already capturing a graph: end that capture before beginning "
            "another on it"
        )
        with pytest.raises(ais.CaptureError, match="is being captured"):
            g.replay()
        ais.delay(0.01, stream=s)
    with pytest.raises(ais.CaptureError, match="was captured already"):
        with g.capture():
            pass
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        g.replay("s")  # type: ignore[arg-type]
    await g.replay(s)  # the refusals left the graph whole
    g.close()
    g.close()  # idempotent
    with pytest.raises(ais.AiostreamError, match="was closed"):
        g.replay(s)


async def test_a_replay_on_another_device_is_refused() -> None:
    ais.virtual.reset(devices=2)
    g = ais.Graph("virtual:0")
    with g.capture():
        ais.delay(0.01)
    other = ais.Stream("virtual:1")
    with pytest.raises(ValueError) as caught:
        g.replay(other)
    assert str(caught.value) == (
        "graph '" + g.name + "' was captured on virtual:0 and cannot be replayed on a stream "
        "of virtual:1: replay it on a stream of its own device"
    )
    assert other.query() and ais.virtual.timeline() == []


async def test_a_graph_of_a_reset_virtual_backend_is_stale() -> None:
    g = ais.Graph("virtual:0")
    s = ais.Stream("virtual:0")
    with g.capture(s):
        ais.delay(0.01, stream=s)
    ais.virtual.reset()
    with pytest.raises(ais.StaleHandleError):
        g.replay(s)
    with pytest.raises(ais.StaleHandleError):
        g.replay(ais.Stream("virtual:0"))


def test_graphs_are_in_the_package() -> None:
    assert ais.Graph.__module__ == "aiostream.graph"
    assert issubclass(ais.CaptureError, ais.AiostreamError)
    assert not issubclass(ais.CaptureError, ais.DeviceError)  # the device is fine


async def test_close_racing_replays_on_another_thread(aiostream_device: ais.Device) -> None:
    """A thread replays in a loop while this one closes: each replay is made whole or refused
    with the documented "closed" error, never a destroyed handle's, and close waits for a
    replay under way (its buffers are not let go while it still uses them)."""
    dev = aiostream_device
    for trial in range(20):
        src, dst, buf = pipeline(dev)
        g = ais.Graph(dev, name=f"raced {trial}")
        with g.capture() as s:
            ais.copy_async(buf, src, stream=s)
            ais.copy_async(dst, buf, stream=s)
        r = ais.Stream(dev)
        raised = closed_while_called(g, functools.partial(g.replay, r))
        assert [type(e) for e in raised] == [ais.AiostreamError], raised
        assert str(raised[0]) == f"graph 'raced {trial}' was closed: it can no longer be replayed"
        await r


def leave_capture(block: AbstractContextManager[ais.Stream], raised: list[BaseException]) -> None:
    try:
        block.__exit__(None, None, None)
    except BaseException as exc:  # noqa: BLE001 - what it was is the check
        raised.append(exc)


async def test_a_capture_left_on_another_thread_is_refused_and_goes_on(
    aiostream_device: ais.Device,
) -> None:
    """A capture's with block left on another thread than the one that entered it raises
    CaptureError before anything is ended; the capture goes on, and its own thread ends it."""
    dev = aiostream_device
    g = ais.Graph(dev, name="wandering")
    block = g.capture()
    s = block.__enter__()
    ais.delay(0.001, stream=s)
    raised: list[BaseException] = []
    thread = threading.Thread(target=leave_capture, args=(block, raised))
    thread.start()
    thread.join()
    assert [type(e) for e in raised] == [ais.CaptureError], raised
    assert str(raised[0]) == (
        "the capture of graph 'wandering' was left on another thread than the one that began "
        "it: the driver ends a capture on its own thread, so leave the with block there (the "
        "capture goes on)"
    )
    assert ais.current_stream(dev) is s
    with pytest.raises(ais.CaptureError):
        ais.HostBuffer(N, device=dev)  # this thread still captures
    ais.delay(0.001, stream=s)
    block.__exit__(None, None, None)
    assert g.nodes == 2
    assert ais.current_stream(dev) is not s
    ais.HostBuffer(N, device=dev)  # the capture is over
    await g.replay()
    g.close()


async def test_work_with_no_stream_in_a_capture_off_the_default_device_is_captured(
    virtual_device: ais.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside the capture of a graph whose device is not the default device, work with no
    stream goes to the capturing stream, not to the default device's current stream."""
    ais.virtual.reset(devices=2)
    monkeypatch.setenv("AIOSTREAM_DEVICE", "virtual:1")
    g = ais.Graph("virtual:0", name="off default")
    with g.capture() as s:
        assert ais.current_stream() is s
        ais.delay(0.001)
    assert g.nodes == 1
    assert ais.current_stream() is ais.default_stream("virtual:1")
    await g.replay()
    g.close()
