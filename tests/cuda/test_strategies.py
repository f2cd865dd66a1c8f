"""Where each CUDA wait strategy waits, and what it adds to the stream: ``poll`` in the loop
alone, ``thread`` and ``callback`` with the watcher from the start (``callback``, and blocking
waits while it or ``hybrid`` is the global strategy, announced by a host function), ``quiet``
(the default) and ``hybrid`` handed to the watcher after the loop's check budget, ``quiet``
with no host function at all, ``hybrid`` with none behind later work; once a wait returns,
its stream is idle, however late the driver runs the host function, and busy again with the
next work.

Run where ``cuda:0`` works: on a GPU, and in CI's CUDA lane against the stand-in driver. Work
that must stay pending is held by a gate (``tests/helpers/gate.py``), and the host functions
aiostream launches are counted where it calls the driver (``launched``), both on any driver; a
host function the driver runs late is a fault only the stand-in injects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, N, held, ptr
from tests.helpers.deadlines import until, until_blocking
from tests.helpers.faults import HOST_FUNC, failing
from tests.helpers.gate import gate, gated
from tests.helpers.protocol import ANNOUNCED, STRATEGIES
from tests.helpers.stand_in import FAKE, hurry, touch

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]

LATE_HOST_FUNCTION = pytest.mark.stand_in("fault injection: a host function the driver runs late")


@pytest.fixture
def launched(own_backend: object) -> Iterator[Callable[[], int]]:
    """How many host functions aiostream launched so far in the test, on any driver: the
    test's own backend opens its device during the test, and its watcher looks the entry point
    up then (``cuGetProcAddress``), getting a launcher that counts (``faults.failing``, with a
    failure never reached). The stand-in's own count, where its hooks are, agrees."""
    fake = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
    with failing(HOST_FUNC, nth=2**62) as fault:

        def made() -> int:
            if FAKE is not None:
                assert FAKE.fake_cuda_host_calls() - fake == fault.made
            return fault.made

        yield made
    assert not fault.failed


# --------------------------------------------------------- each strategy


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_each_strategy_waits_where_it_says(
    anyio_backend: object, strategy: str, launched: Callable[[], int]
) -> None:
    """``poll``: the loop alone reads the mark, and the watcher never sees the wait; ``thread``
    and ``callback``: the watcher has it from the start, the latter with a host function after
    the mark; ``quiet`` and ``hybrid``: the watcher has it after the loop's check budget,
    with a host function under ``hybrid`` only."""
    s = ais.Stream(DEV)
    with gated(s):  # the work outlasts the checks
        ais.delay(0.001, stream=s)
        calls = launched()

        async def wait() -> None:
            await s.synchronize(strategy=strategy)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until(lambda: bool(ais.pending_waits()), "the wait to begin")
            if strategy not in ("quiet", "hybrid"):  # (their check budget may be over)
                assert held()["watched"] == (strategy != "poll")
            await anyio.sleep(0.05)
            assert held()["watched"] == (strategy != "poll")
            assert not s.query()
            assert launched() - calls == (strategy in ANNOUNCED)
            tg.cancel_scope.cancel()
        assert held()["watched"] == 0
        assert not ais.pending_waits()
    await s.synchronize()


@pytest.mark.parametrize("chosen", [None, *STRATEGIES])
async def test_the_default_strategy_is_the_one_set(
    anyio_backend: object,
    chosen: str | None,
    launched: Callable[[], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait with no ``strategy`` of its own takes the one ``set_wait_strategy`` chose
    (``quiet`` where neither it nor the environment chose one), the capture included: the
    watcher has it unless polled, and a host function announces it under ``callback`` and
    nothing else (``hybrid`` adds one only when the loop hands the wait over, after its check
    budget: here the work is held until the test lets it go; ``quiet``, the default, never)."""
    monkeypatch.delenv("AIOSTREAM_WAIT_STRATEGY", raising=False)
    ais.set_wait_strategy(chosen)
    strategy = chosen or "quiet"
    s = ais.Stream(DEV)
    release = gate(s)
    try:
        ais.delay(0.001, stream=s)
        calls = launched()
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.synchronize)
            await until(
                lambda: held()["watched"] == (strategy != "poll") and bool(ais.pending_waits()),
                "the wait to begin, watched by the watcher unless polled",
            )
            await anyio.sleep(0.01 if strategy in ("quiet", "hybrid") else 0)
            assert held()["watched"] == (strategy != "poll")
            [pending] = ais.pending_waits()
            assert pending.strategy == strategy
            assert launched() - calls == (strategy in ANNOUNCED)
            release()
    finally:
        release()
    assert s.query()
    assert not ais.pending_waits()


async def test_the_default_launches_no_host_function_anywhere(
    anyio_backend: object, launched: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no strategy chosen, nothing aiostream does puts a host function on a stream (one
    waiting behind long work may hold every stream's later work on a GPU): awaits of streams
    and events, short and long, on a stream of its own and on one handed out, an event's
    wait before and after a re-record, a graph's replay awaited, a copy, a cancelled wait
    and a blocking wait from another thread."""
    monkeypatch.delenv("AIOSTREAM_WAIT_STRATEGY", raising=False)
    ais.set_wait_strategy(None)
    calls = launched()
    own, out = ais.Stream(DEV), ais.Stream(DEV)
    out.__cuda_stream__()  # handed out: others may submit unseen
    for s in (own, out):
        for seconds in (0.0002, 0.01):  # within the check budget, and past it
            ais.delay(seconds, stream=s)
            await s
            ais.delay(seconds, stream=s)
            e = s.record_event()
            await e
        ais.delay(0.005, stream=s)
        e = s.record_event()
        ais.delay(0.001, stream=s)
        e.record(s)  # re-recorded: the wait begun before goes on for what it captured
        await e
        with anyio.move_on_after(0.002):  # cancelled while handed over
            ais.delay(0.05, stream=s)
            await s
        await s
    host, buf = ais.HostBuffer(N, device=DEV), ais.DeviceBuffer(N, DEV)
    g = ais.Graph(DEV)
    with g.capture() as c:
        ais.copy_async(buf, host, stream=c)
        ais.delay(0.002, stream=c)
    await g.replay(own)
    ais.copy_async(host, buf, stream=own)
    await own
    ais.delay(0.01, stream=own)
    await anyio.to_thread.run_sync(own.record_event().synchronize_blocking)
    g.close()
    assert launched() - calls == 0


@pytest.mark.parametrize("strategy", [None, *STRATEGIES])
def test_a_blocking_wait_is_announced_as_the_strategy_says(
    strategy: str | None, launched: Callable[[], int]
) -> None:
    """``synchronize_blocking()`` waits in its thread for the watcher's word, and the watcher
    hears of the wait as the global strategy says: from a host function after its mark under
    ``hybrid`` and ``callback`` (not at its next health check, 50 ms later), by polling under
    the others and the default (``quiet``), which add no host function. (The work is held
    until the watcher has the wait, then let go from another thread: however busy the
    machine, the wait starts before it ends.)"""
    ais.set_wait_strategy(strategy)
    announced = ais.get_wait_strategy() in ANNOUNCED
    s = ais.Stream(DEV)
    for what in ("stream", "event"):
        release = gate(s)
        try:
            ais.delay(0.001, stream=s)
            awaited = s if what == "stream" else s.record_event()
            calls = launched()

            def release_once_watched() -> None:
                until_blocking(
                    lambda: held()["watched"] >= 1,
                    "the watcher to have the wait",
                )
                release()  # noqa: B023

            helper = threading.Thread(target=release_once_watched)
            helper.start()
            awaited.synchronize_blocking()
            helper.join(10)
            assert not helper.is_alive()
        finally:
            release()
        assert s.query(), what
        assert held()["watched"] == 0, what
        assert launched() - calls == announced, what


def test_synchronize_blocking_waits_through_the_watcher() -> None:
    """A blocking wait ends once the work does, through the watcher, which holds it no more
    then; its host function is a C function of the driver's thread's own, never Python (the
    stand-in counts those)."""
    python_calls = FAKE.fake_cuda_host_calls_python() if FAKE is not None else 0
    s = ais.Stream(DEV)
    ais.delay(0.05, stream=s)
    e = s.record_event()
    start = time.monotonic()
    e.synchronize_blocking()
    assert e.query() and 0.04 <= time.monotonic() - start < 2.0
    assert held()["watched"] == 0
    if FAKE is not None:
        assert FAKE.fake_cuda_host_calls_python() == python_calls


@pytest.mark.parametrize("later", ["kernel", "event wait and kernel"])
async def test_a_handed_over_wait_gets_no_host_function_behind_later_work(
    anyio_backend: object, later: str, launched: Callable[[], int]
) -> None:
    """hybrid's host function comes when the loop hands the wait over; if work of the user's
    was submitted to the stream since the capture (a kernel; or a wait on an event, then a
    kernel: each counts), a host function would wait for it too: the watcher polls the mark
    instead, and the wait ends with the work it captured, while the later work is still held
    (by a second gate, behind the captured work)."""
    s = ais.Stream(DEV)
    if later != "kernel":
        other = ais.Stream(DEV)
        ais.delay(0.01, stream=other)
        pending = other.record_event()
    captured = gate(s)
    try:
        ais.delay(0.001, stream=s)
        calls = launched()
        done = anyio.Event()

        async def wait() -> None:
            await s.synchronize(strategy="hybrid")
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            with anyio.fail_after(5):
                while not ais.pending_waits():  # the capture is made
                    await anyio.sleep(0)
            with gated(s):  # holds the later work, not the captured
                if later != "kernel":
                    s.wait_event(pending)
                ais.delay(0.001, stream=s)  # later work of the user's
                await until(lambda: held()["watched"] == 1, "the loop to hand the wait over")
                assert not done.is_set()
                captured()
                with anyio.fail_after(5):
                    await done.wait()  # the later work is still held
                assert not s.query()  # the later work goes on
                assert launched() == calls
    finally:
        captured()
    await s.synchronize()
    assert s.query()


# ----------------------------------------------------- idle once awaited


@LATE_HOST_FUNCTION
@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_an_awaited_stream_is_idle_though_the_host_function_is_late(
    anyio_backend: object, strategy: str
) -> None:
    """The host function that announces a wait is aiostream's, not the user's work: once
    ``await s.synchronize()`` returns, ``s.query()`` is True even while the driver has not yet
    run it; and the wait does not wait for it (the watcher's sweeps find the flag)."""
    s = ais.Stream(DEV)
    FAKE.fake_cuda_host_fn_delay(round(0.5e9))
    try:
        ais.delay(0.01, stream=s)
        start = time.monotonic()
        await s.synchronize(strategy=strategy)
        took = time.monotonic() - start
        assert s.query()
        assert took < 0.3, took
        with gated(s):  # work of the user's after it: busy again
            ais.delay(0.001, stream=s)
            assert not s.query()
    finally:
        FAKE.fake_cuda_host_fn_delay(0)
        hurry()
    await s.synchronize()
    assert s.query()


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_an_awaited_handed_out_stream_is_idle(anyio_backend: object, strategy: str) -> None:
    """On a stream whose handle was handed out, a wait's host function comes right before its
    mark: once ``await s.synchronize()`` returns, ``s.query()`` (the driver's answer there) is
    True, as after ``synchronize_blocking()``: no host function of aiostream's is left queued,
    after short waits (the loop's check budget) and long ones (the watcher's), even where
    the driver runs host functions late (the stand-in delays them by 20 ms here)."""
    s = ais.Stream(DEV)
    s.__cuda_stream__()
    if FAKE is not None:
        FAKE.fake_cuda_host_fn_delay(round(0.02e9))
    try:
        for i in range(20):
            ais.delay(0.003 if i % 2 else 0.0002, stream=s)
            with anyio.fail_after(5):
                await s.synchronize(strategy=strategy)
            assert s.query(), i
    finally:
        if FAKE is not None:
            FAKE.fake_cuda_host_fn_delay(0)


@pytest.mark.parametrize("strategy", sorted(ANNOUNCED))
async def test_an_allocation_after_an_awaited_mark_makes_the_stream_busy_again(
    anyio_backend: object, strategy: str
) -> None:
    """A stream awaited with a host function is idle once the work before its mark is done,
    the host function still queued or not; work submitted after the mark makes it busy
    again, a stream-ordered allocation too (held by a gate; on the stand-in, a kernel reads
    the memory after it)."""
    s = ais.Stream(DEV)
    ais.delay(0.02, stream=s)
    with anyio.fail_after(5):
        await s.synchronize(strategy=strategy)
    assert s.query()
    with gated(s):
        with ais.use_stream(s):
            buf = ais.DeviceBuffer(N, DEV)  # cuMemAllocAsync on s
        assert not s.query()
        if FAKE is not None:
            touch(s, ptr(buf), N)
            assert not s.query()
    with anyio.fail_after(5):
        await s.synchronize(strategy=strategy)
    assert s.query()
