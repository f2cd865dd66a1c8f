"""CUDA waits at scale: a bounded set of threads per device whatever the load, pools that
shrink, cancellation that frees everything at once, hung kernels, and what each event capture
costs.

Run where ``cuda:0`` works: on a GPU, and against the stand-in driver, which
``test_fake_driver.py`` runs this file on. Tests that need its hooks skip on a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream import _backends
from tests.helpers.process import in_spawned_process, run_python
from tests.helpers.stand_in import (
    FAKE,
    hurry,
    keeping_the_contract,
    needs_stand_in,
    take_violations,
)

pytestmark = pytest.mark.cuda

DEV = "cuda:0"


@pytest.fixture(autouse=True)
def default_strategy() -> Iterator[None]:
    """Each test starts with no contract violation counted on the stand-in, and must end
    with none; the defaults come back after it."""
    with keeping_the_contract():
        yield
        ais.set_wait_strategy(None)
        ais.set_debug(False)
        hurry()  # end the kernels that never end


def held() -> dict[str, int]:
    return _backends.get("cuda").held(0)  # type: ignore[attr-defined, no-any-return]


def ours() -> list[str]:
    """aiostream's threads now alive for cuda:0 (another device's watcher may live on from an
    earlier test), and any of aiostream's that names no device."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("aiostream") and ("cuda:" not in t.name or DEV in t.name)
    ]


class ThreadPeak:
    """The most aiostream threads and Python threads alive at once, sampled every 2 ms."""

    def __init__(self) -> None:
        self.ours = 0
        self.python = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="test sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.ours = max(self.ours, len(ours()))
            self.python = max(self.python, threading.active_count())

    def __enter__(self) -> ThreadPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def settle(before_slots: int) -> dict[str, int]:
    """Wait (up to 2 s) for the watcher to free the slots of cancelled waits."""
    with anyio.fail_after(2):
        while (now := held())["slots"] > before_slots:
            await anyio.sleep(0.01)
    return now


# ---------------------------------------------------------------------- the host function


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX semaphores of glibc")
def test_the_watcher_sleeps_on_a_semaphore_that_sem_post_wakes() -> None:
    """The host function that announces a wait is libc's ``sem_post``, handed to the driver
    by its address; the watcher's thread sleeps in ``sem_timedwait`` until it is posted."""
    from aiostream._backends.cuda.watcher import Semaphores

    sems = Semaphores()
    libc = ctypes.CDLL(None)
    assert sems.post_address == ctypes.cast(libc.sem_post, ctypes.c_void_p).value != 0
    sem = sems.new()
    assert not sems.wait(sem, 0.01)  # nothing posted: the time limit
    sems.post(sem)
    sems.post(sem)
    assert sems.wait(sem, 0.01)
    assert sems.wait(sem, None)
    assert not sems.wait(sem, 0.0)


# ---------------------------------------------------------------------- scale


@pytest.mark.parametrize("strategy", ["hybrid", "thread", "callback", "poll"])
async def test_a_thousand_waits_on_a_hundred_streams_use_one_thread(
    anyio_backend: object, strategy: str
) -> None:
    """1,000 events on 100 streams awaited at once, a third cancelled at random: at most one
    thread of aiostream's (the device's watcher) however many waits, and nothing held after."""
    before = held()
    base_python = threading.active_count()
    rng = random.Random(21)
    streams = [ais.Stream(DEV) for _ in range(100)]
    events = []
    for i, s in enumerate(streams):
        # nothing completes before the waits have begun and the cancelled ones have given up,
        # however loaded the machine (the stand-in's kernels end when the test says)
        ais.delay(3600.0 if FAKE is not None else 1.0, stream=s)
        for k in range(10):
            ais.delay(0.01 + 0.002 * ((i + k) % 7), stream=s)  # 0.1 to 0.2 s a stream
            events.append(s.record_event())
    cancel = [rng.uniform(0, 0.1) if rng.random() < 1 / 3 else None for _ in events]
    outcomes = {"done": 0, "cancelled": 0}

    async def wait(e: ais.Event, after: float | None) -> None:
        if after is not None:
            with anyio.move_on_after(after) as scope:
                await e.synchronize(strategy=strategy)
            if scope.cancelled_caught:
                outcomes["cancelled"] += 1
                return
        else:
            await e.synchronize(strategy=strategy)
        assert e.query()
        outcomes["done"] += 1

    cancelled = sum(after is not None for after in cancel)
    with ThreadPeak() as peak:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for e, after in zip(events, cancel, strict=True):
                    tg.start_soon(wait, e, after)
                while outcomes["cancelled"] < cancelled:
                    await anyio.sleep(0.001)
                hurry()  # the kernels end now (on a GPU, in their time)
    assert outcomes == {"done": 1000 - cancelled, "cancelled": cancelled} and cancelled > 300
    assert peak.ours <= 1, peak.ours  # the watcher of cuda:0, whatever the number of waits
    assert peak.python - base_python <= 2, (peak.python, base_python)  # it, and the sampler
    assert ais.pending_waits() == []
    after = await settle(before["slots"])
    assert after["watched"] == 0
    # no stream or event per wait (the health event may be new)
    assert after["streams"] <= 1 and after["events"] <= before["events"] + 1, after
    assert len(ours()) <= 1


async def test_flag_memory_grows_with_pending_waits_and_shrinks_when_idle(
    anyio_backend: object,
) -> None:
    before = held()
    s = ais.Stream(DEV)
    # nothing completes before every wait has begun, however loaded the machine (the stand-in's
    # kernel ends when the test says)
    ais.delay(3600.0 if FAKE is not None else 3.0, stream=s)
    pending = [s.record_event() for _ in range(5000)]  # more waits than a chunk has slots

    async def wait(e: ais.Event) -> None:
        await e.synchronize(strategy="thread")

    captured = 0
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for e in pending:
                tg.start_soon(wait, e)
            while len(ais.pending_waits()) < 5000:  # the tasks have started their waits
                await anyio.sleep(0.001)
            captured = held()["chunks"]
            hurry()  # the kernel ends now (on a GPU, in its time)
    assert captured >= 2
    after = await settle(before["slots"])
    with anyio.fail_after(2):
        while held()["chunks"] > 1:
            await anyio.sleep(0.01)
    assert after["watched"] == 0


# ---------------------------------------------------------------------- hung kernels


@pytest.mark.parametrize("strategy", ["hybrid", "thread", "callback", "poll"])
async def test_a_wait_on_a_hung_kernel_times_out_and_leaves_nothing(
    anyio_backend: object, strategy: str
) -> None:
    before = held()
    s = ais.Stream(DEV)
    ais.delay(3600.0 if FAKE is not None else 30.0, stream=s)  # a kernel that does not end
    e = s.record_event()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.2):
            await e.synchronize(strategy=strategy)
    late = time.monotonic() - start - 0.2
    assert late < 0.05, f"TimeoutError {late * 1e3:.1f} ms after its deadline"
    assert ais.pending_waits() == []
    now = held()
    assert now["watched"] == 0  # no wait left; its slot drains when the kernel ends
    assert now["slots"] <= before["slots"] + 1
    assert now["streams"] <= 1 and now["events"] <= before["events"] + 1
    assert len(ours()) <= 1  # no thread blocked on the kernel


async def test_pending_waits_name_the_stream_task_origin_and_age(anyio_backend: object) -> None:
    ais.set_debug(True)
    s = ais.Stream(DEV)
    ais.delay(3600.0 if FAKE is not None else 30.0, stream=s)  # submitted here
    e = s.record_event()
    seen: list[Any] = []

    async def stuck() -> None:
        await e.synchronize()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stuck, name="stuck task")
        await anyio.sleep(0.1)
        seen = ais.pending_waits()
        tg.cancel_scope.cancel()
    assert len(seen) == 1
    wait = seen[0]
    assert wait.task == "stuck task" and wait.device == DEV
    assert wait.subject == f"event {e.event_id} on stream {s.stream_id}"
    assert wait.waited >= 0.09
    assert wait.recorded_at is not None and Path(__file__).name in wait.recorded_at
    assert f"waited {wait.waited:.3f} s on event" in str(wait)
    assert ais.pending_waits() == []


# ---------------------------------------------------------------------- event captures


async def test_an_event_wait_keeps_its_capture_when_the_event_is_recorded_again(
    anyio_backend: object,
) -> None:
    """Awaited before it is recorded again elsewhere, an event still completes its await when
    the work it captured then completes, not the work of its new record."""
    s, t = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(0.05, stream=s)
    e = s.record_event()
    ais.delay(5.0, stream=s)  # later work on s: the wait queries e itself
    finished = []

    async def wait() -> None:
        await e.synchronize(strategy="thread")
        finished.append(time.monotonic())

    start = time.monotonic()
    with anyio.fail_after(3):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.sleep(0.01)
            ais.delay(10.0, stream=t)
            e.record(t)  # the await goes on waiting for the 0.05 s of work it captured
    assert finished and finished[0] - start < 1.0
    assert not e.query()  # e itself now stands for the 10 s kernel


@pytest.mark.parametrize("strategy", ["callback", "hybrid", "blocking"])
async def test_a_wait_on_the_event_of_a_dropped_stream_launches_nothing_on_it(
    anyio_backend: object, strategy: str
) -> None:
    """The stream an event was recorded on is dropped (destroyed, its pending work marked)
    before the event is awaited: the wait ends when the work does, and no host function is
    launched on the destroyed stream (the stand-in counts that as a contract violation)."""
    s = ais.Stream(DEV)
    ais.delay(0.1, stream=s)
    e = s.record_event()
    del s
    gc.collect()
    with anyio.fail_after(5):
        if strategy == "blocking":
            await anyio.to_thread.run_sync(e.synchronize_blocking)
        else:
            await e.synchronize(strategy=strategy)
    assert e.query()


async def test_an_event_wait_reads_the_mark_of_its_record(anyio_backend: object) -> None:
    """Every record puts a mark right after it: a wait on the event reads that mark, however
    much was submitted after the record, and takes no slot of its own."""
    s = ais.Stream(DEV)
    ais.delay(0.05, stream=s)
    first = s.record_event()
    ais.delay(0.05, stream=s)
    passed = s.record_event()
    ais.delay(0.05, stream=s)
    base = held()["slots"]

    async def wait(e: ais.Event) -> None:
        await e.synchronize(strategy="thread")

    async def waiting(n: int) -> None:
        with anyio.fail_after(5):
            while len(ais.pending_waits()) < n:
                await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, passed)  # work was submitted after it: its record's mark
        await waiting(1)
        assert held()["slots"] == base
        tg.start_soon(wait, s.record_event())  # a new record: one mark more
        await waiting(2)
        assert held()["slots"] == base + 1
        assert not s.query()  # the checks above ran while the waits were pending
    assert first.query() and s.query()


async def test_a_stream_handed_to_another_library_gets_no_host_function(
    anyio_backend: object,
) -> None:
    """Once its handle is handed out (``__cuda_stream__``), others may submit to a stream: a
    wait on an event recorded there reads its record's mark and adds no host function, which
    would wait for their later work too."""
    s = ais.Stream(DEV)
    s.__cuda_stream__()
    ais.delay(0.02, stream=s)
    e = s.record_event()
    base = held()["slots"]
    calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(e.synchronize)
        with anyio.fail_after(5):
            while not ais.pending_waits():
                await anyio.sleep(0.001)
        assert held()["slots"] == base
    assert e.query()
    if FAKE is not None:
        assert FAKE.fake_cuda_host_calls() == calls


@pytest.mark.parametrize("strategy", ais._waiting.STRATEGIES)
async def test_each_strategy_waits_where_it_says(anyio_backend: object, strategy: str) -> None:
    """``poll``: the loop alone reads the mark, and the watcher never sees the wait; ``thread``
    and ``callback``: the watcher has it from the start, the latter with a host function after
    the mark; ``hybrid``: the watcher has it, with a host function, after the loop's first
    millisecond."""
    s = ais.Stream(DEV)
    ais.delay(3600.0 if FAKE is not None else 1.0, stream=s)  # it outlasts the checks
    calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0

    async def wait() -> None:
        await s.synchronize(strategy=strategy)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        with anyio.fail_after(5):
            while not ais.pending_waits():
                await anyio.sleep(0)
        if strategy != "hybrid":  # (hybrid's first millisecond may be over already)
            assert held()["watched"] == (strategy != "poll")
        await anyio.sleep(0.05)
        assert held()["watched"] == (strategy != "poll")
        if FAKE is not None:
            assert FAKE.fake_cuda_host_calls() - calls == (strategy in ais._waiting.WAKE)
        tg.cancel_scope.cancel()
    assert held()["watched"] == 0


@pytest.mark.parametrize("strategy", ["thread", "callback"])
async def test_the_watcher_polls_from_50us_backing_off_to_2ms(
    anyio_backend: object, strategy: str
) -> None:
    """While a wait no host function announces is watched, the watcher sleeps 50 us after
    progress, then a quarter of the quiet time, at most 2 ms; with only announced waits, it
    sleeps until the next health check (50 ms)."""
    watcher = _backends.get("cuda")._devices.get(0).watcher  # type: ignore[attr-defined]
    hurry()  # waits earlier tests left watched (cancelled ones linger) end and are dropped
    with anyio.fail_after(5):
        while held()["watched"]:
            await anyio.sleep(0.001)
    s = ais.Stream(DEV)
    ais.delay(3600.0 if FAKE is not None else 1.0, stream=s)

    async def wait() -> None:
        await s.synchronize(strategy=strategy)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        with anyio.fail_after(5):
            while not held()["watched"]:
                await anyio.sleep(0.001)
        with watcher.lock:
            since = watcher.progress_at
            if strategy == "callback":  # past a chase: a post (an earlier test's host
                since = max(since, watcher.chase_until)  # function, late) starts one
            sleeps = [watcher._timeout(since + quiet) for quiet in (0.0, 0.004, 1.0, 60.0)]
        tg.cancel_scope.cancel()
    if strategy == "thread":
        assert sleeps == pytest.approx([50e-6, 1e-3, 2e-3, 2e-3], rel=1e-6)
    else:
        assert sleeps == [0.05] * 4


async def test_a_wait_on_another_librarys_event_follows_its_latest_record(
    anyio_backend: object,
) -> None:
    """An event aiostream did not record (``as_event``) carries no mark: a wait on it asks the
    driver about the event itself, so a record made meanwhile, which aiostream never sees,
    decides when it ends."""
    busy, idle = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(3600.0 if FAKE is not None else 2.0, stream=busy)
    owner = busy.record_event()
    foreign = ais.as_event(owner.event_id, DEV)
    for strategy in ais._waiting.STRATEGIES:
        owner.record(busy)
        finished: list[str] = []

        async def wait(strategy: str = strategy, finished: list[str] = finished) -> None:
            await foreign.synchronize(strategy=strategy)
            finished.append(strategy)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.sleep(0.01)
            assert not finished  # its record on busy is pending
            owner.record(idle)  # recorded again, on a stream with nothing to do
            with anyio.fail_after(5):
                while not finished:
                    await anyio.sleep(0.001)
        assert not busy.query()


@needs_stand_in
@pytest.mark.parametrize("strategy", ais._waiting.STRATEGIES)
async def test_the_default_strategy_is_the_one_set(anyio_backend: object, strategy: str) -> None:
    """A wait with no ``strategy`` of its own takes the one ``set_wait_strategy`` chose, the
    capture included: a host function announces it under ``callback`` and nothing else
    (``hybrid`` adds one only when the loop hands the wait over, after its first
    millisecond: here the work lasts an hour, which a test then ends)."""
    ais.set_wait_strategy(strategy)
    s = ais.Stream(DEV)
    ais.delay(3600.0, stream=s)
    calls = FAKE.fake_cuda_host_calls()
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.synchronize)
        with anyio.fail_after(5):
            while held()["watched"] != (strategy != "poll") or not ais.pending_waits():
                await anyio.sleep(0.001)
        await anyio.sleep(0.01 if strategy == "hybrid" else 0)
        assert FAKE.fake_cuda_host_calls() - calls == (strategy in ais._waiting.WAKE)
        hurry()
    assert s.query()


@needs_stand_in
def test_a_blocking_wait_is_announced_by_a_host_function() -> None:
    """``synchronize_blocking()`` waits in its thread for the watcher's word, and the watcher
    hears of the wait from a host function after its mark (as with ``callback``), not at its
    next health check, 50 ms later."""
    s = ais.Stream(DEV)
    for what in ("stream", "event"):
        ais.delay(0.005, stream=s)
        awaited = s if what == "stream" else s.record_event()
        calls = FAKE.fake_cuda_host_calls()
        awaited.synchronize_blocking()
        assert FAKE.fake_cuda_host_calls() - calls == 1, what
        assert s.query()


@needs_stand_in
async def test_short_hybrid_waits_add_no_host_function(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hybrid hands a wait to the watcher, with its host function, only after the loop's
    first millisecond: waits shorter than that add nothing to the stream. (The window is
    widened here, so that a loaded machine's slow loop turns do not make the waits long.)"""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.5)
    s = ais.Stream(DEV)
    calls = FAKE.fake_cuda_host_calls()
    for _ in range(20):
        ais.delay(50e-6, stream=s)
        await s.synchronize(strategy="hybrid")
    assert FAKE.fake_cuda_host_calls() == calls


@needs_stand_in
@pytest.mark.parametrize("later", ["kernel", "event wait and kernel"])
async def test_a_handed_over_wait_gets_no_host_function_behind_later_work(
    anyio_backend: object, later: str
) -> None:
    """hybrid's host function comes when the loop hands the wait over; if work of the user's
    was submitted to the stream since the capture (a kernel; or a wait on an event, then a
    kernel: each counts), a host function would wait for it too: the watcher polls the mark
    instead, and the wait ends with the work it captured."""
    s = ais.Stream(DEV)
    if later != "kernel":
        other = ais.Stream(DEV)
        ais.delay(0.01, stream=other)
        pending = other.record_event()
    ais.delay(0.05, stream=s)
    calls = FAKE.fake_cuda_host_calls()
    finished: list[float] = []

    async def wait() -> None:
        await s.synchronize(strategy="hybrid")
        finished.append(time.monotonic())

    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        with anyio.fail_after(0.04):
            while not ais.pending_waits():  # the capture is made
                await anyio.sleep(0)
        if later != "kernel":
            s.wait_event(pending)
        ais.delay(0.5, stream=s)  # later work of the user's
    assert finished and finished[0] - start < 0.3
    assert FAKE.fake_cuda_host_calls() == calls
    assert not s.query()  # the later work goes on
    await s.synchronize()


@needs_stand_in
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
        ais.delay(0.01, stream=s)  # work of the user's after it: busy again
        assert not s.query()
    finally:
        FAKE.fake_cuda_host_fn_delay(0)
    await s.synchronize()
    assert s.query()


@pytest.mark.parametrize("strategy", ["hybrid", "callback", "thread", "poll"])
async def test_an_awaited_handed_out_stream_is_idle(anyio_backend: object, strategy: str) -> None:
    """On a stream whose handle was handed out, a wait's host function comes right before its
    mark: once ``await s.synchronize()`` returns, ``s.query()`` (the driver's answer there) is
    True, as after ``synchronize_blocking()``: no host function of aiostream's is left queued,
    after short waits (the loop's first millisecond) and long ones (the watcher's), even where
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


@needs_stand_in
@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_a_handed_out_streams_wait_ends_soon_after_its_host_function(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """The mark after the host function lands only once the driver's thread has returned from
    it: the watcher, posted, keeps looking for it for a while, rather than at its next health
    check, 50 ms later. (The stand-in's thread takes 8 ms to return here; hybrid hands the
    wait over at once.)"""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
    s = ais.Stream(DEV)
    s.__cuda_stream__()
    took = []
    FAKE.fake_cuda_host_fn_return_delay(round(0.008e9))
    try:
        for _ in range(5):
            start = time.monotonic()  # before the work: 9 ms at least, however late we run
            ais.delay(0.001, stream=s)
            with anyio.fail_after(5):
                await s.synchronize(strategy=strategy)
            took.append(time.monotonic() - start)
            assert s.query()
    finally:
        FAKE.fake_cuda_host_fn_return_delay(0)
    took.sort()
    assert 0.009 <= took[0] and took[2] < 0.035, took  # the health check: 50 ms and more


@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_a_record_after_an_announced_wait_is_complete(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Once ``await e.synchronize()`` returns, the host function that announced it may still be
    running on the driver's thread, and a record after it completes on the device only once
    that returns (the stand-in's thread takes 8 ms to return here). An event recorded then
    captured no work of the user's that had not completed: it, its stream, and an earlier
    event recorded again, are complete at once, and ``elapsed_time`` reads them (waiting the
    host function out), as where no host function was added."""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
    s = ais.Stream(DEV)
    start = ais.Event(DEV, enable_timing=True)
    if FAKE is not None:
        FAKE.fake_cuda_host_fn_return_delay(round(0.008e9))
    try:
        for _ in range(3):
            start.record(s)
            ais.delay(0.001, stream=s)
            e = s.record_event()
            with anyio.fail_after(5):
                await e.synchronize(strategy=strategy)
            end = s.record_event(ais.Event(DEV, enable_timing=True))
            e.record(s)
            assert "id=" in repr(e)  # its handle named in a message is not handed out
            assert end.query() and e.query() and s.query()
            assert start.elapsed_time(end) >= 0.0
            ais.delay(0.001, stream=s)  # the user's work after them: not complete
            later = s.record_event()
            assert not (later.query() or s.query()) or FAKE is None
            await s.synchronize(strategy=strategy)
    finally:
        if FAKE is not None:
            FAKE.fake_cuda_host_fn_return_delay(0)


@needs_stand_in
async def test_elapsed_time_that_waits_out_a_host_function_checks_that_wait(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``elapsed_time`` on an event recorded right after an announced wait waits, in the
    driver, for the host function before it to return (``cuEventSynchronize``); where that
    call fails, the error names it, its device and code."""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
    s = ais.Stream(DEV)
    start = ais.Event(DEV, enable_timing=True)
    FAKE.fake_cuda_host_fn_return_delay(round(0.3e9))  # returning still, however late we run
    try:
        start.record(s)
        ais.delay(0.001, stream=s)
        with anyio.fail_after(5):
            await s.record_event().synchronize(strategy="callback")
        end = s.record_event(ais.Event(DEV, enable_timing=True))
        assert FAKE.fake_cuda_fail_call(b"cuEventSynchronize", 1, 999)
        with pytest.raises(ais.CudaError) as info:
            start.elapsed_time(end)
        assert str(info.value).startswith(
            "cuEventSynchronize failed on cuda:0: CUDA_ERROR_UNKNOWN (999)"
        ), info.value
    finally:
        FAKE.fake_cuda_clear_error()
        FAKE.fake_cuda_host_fn_return_delay(0)
    assert start.elapsed_time(end) >= 0.0


async def test_a_free_after_the_users_work_leaves_the_stream_busy(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer freed on its stream (``cuMemFreeAsync``) after an announced wait and the
    user's later work: the stream is busy until that work completes, the free being
    submitted work too."""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
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


@pytest.mark.parametrize("strategy", ["hybrid", "callback"])
async def test_a_record_after_others_work_is_not_complete(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Others may record another library's event unseen, and, once a stream's handle is
    handed out, submit to it unseen: an event recorded after an announced wait is then
    complete only once the driver says so."""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
    s = ais.Stream(DEV)
    owner = ais.Event(DEV)
    ais.delay(0.001, stream=s)
    owner.record(s)
    foreign = ais.as_event(owner.event_id, DEV)
    foreign.record(s)
    with anyio.fail_after(5):
        await foreign.synchronize(strategy=strategy)
    elsewhere = ais.Stream(DEV)
    ais.delay(0.2, stream=elsewhere)
    owner.record(elsewhere)  # the same CUDA event, recorded where the wrapper does not see
    assert not foreign.query()
    others = ais.ExternalStream(s.__cuda_stream__()[1], DEV)
    ais.delay(0.2, stream=others)  # another library's work, unseen by s
    after = s.record_event()
    assert not after.query() and not s.query()
    with anyio.fail_after(5):
        await after.synchronize()
        await foreign.synchronize()  # its latest record is owner's, on elsewhere
    assert foreign.query() and owner.query()


async def test_an_event_handed_out_may_be_recorded_unseen(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once an event's handle is handed out (``event_id``), others may record it unseen:
    recorded after an announced wait, it is complete only once the driver says so, and a wait
    on it follows that latest record."""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
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


@needs_stand_in  # the driver documents opening an IPC handle in another process only
async def test_an_opened_ipc_event_may_be_recorded_by_its_exporter_unseen(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event opened from an IPC handle is recorded by the process that exported it too,
    unseen: recorded here after an announced wait, then there, it is complete only once the
    driver says so. (The stand-in lets a process open its own handle: the opened event
    follows the exported one.)"""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
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


@needs_stand_in  # the driver documents opening an IPC handle in another process only
async def test_an_exported_event_may_be_recorded_by_its_opener_unseen(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once its IPC handle is out, an event is recorded by the process that opens it too,
    unseen: recorded here after an announced wait, then there, it is complete only once the
    driver says so. (The stand-in lets a process open its own handle: a record of the opened
    event is one of the exported event.)"""
    monkeypatch.setattr(ais._waiting, "HYBRID_HANDOFF_S", 0.0)
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
    ais.delay(3600.0 if FAKE is not None else 0.5, stream=t)
    buf.record_stream(t)  # t's work so far uses the buffer
    try:
        with ais.use_stream(s):
            buf.ipc_handle()
        assert not s.query()
    finally:
        hurry()
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
        # the device, busy till it completes, as cuStreamQuery says now
        FAKE.fake_cuda_fail_call(b"cuStreamQuery", 1, 600)  # CUDA_ERROR_NOT_READY
        busy = not s.query()
        del buf
        return announced, busy

    try:
        announced, busy = anyio.run(main)
        gc.collect()
        out.put((announced, busy, take_violations()))
    except BaseException as exc:  # reported to the parent, which fails the test with it
        out.put((type(exc).__name__, str(exc), None))


@needs_stand_in  # CUDA_ERROR_NOT_READY asked of it: its own wait is on the host
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


# ---------------------------------------------------------------------- from threads


@needs_stand_in
def test_synchronize_blocking_waits_through_the_watcher() -> None:
    python_calls = FAKE.fake_cuda_host_calls_python()
    s = ais.Stream(DEV)
    ais.delay(0.05, stream=s)
    e = s.record_event()
    start = time.monotonic()
    e.synchronize_blocking()
    assert e.query() and 0.04 <= time.monotonic() - start < 2.0
    assert held()["watched"] == 0
    assert FAKE.fake_cuda_host_calls_python() == python_calls


# ---------------------------------------------------------------------- the watcher's parts


async def test_mark_values_wrap_to_one_never_zero(anyio_backend: object) -> None:
    """The values marks write count up to 2**32 - 1, the largest a 32-bit write holds, then
    start again at 1, never 0, the value of fresh flag memory; waits across the wrap end with
    their work."""
    from aiostream._backends.cuda.watcher import Mark

    s = ais.Stream(DEV)
    s.record_event()
    dev = _backends.get("cuda")._devices.get(0)  # type: ignore[attr-defined]
    flags = dev.watcher.flags
    with dev.lock:
        flags.values = 0xFFFFFFFE
        marks = [Mark(), Mark()]
        for mark in marks:
            flags.take(mark)
        assert [m.value for m in marks] == [0xFFFFFFFF, 1]
        for mark in marks:
            flags.free(mark)
        flags.values = 0xFFFFFFFE
    for _ in range(3):
        ais.delay(0.001, stream=s)
        e = s.record_event()
        with anyio.fail_after(5):
            await e.synchronize(strategy="poll")
        assert e.query()
    assert 1 <= flags.values < 0xFFFFFFFE


async def test_a_value_left_in_a_free_slot_is_not_read_as_its_next_mark(
    anyio_backend: object,
) -> None:
    """Mark values repeat once they wrap (every 2**32 - 1 marks, about an hour at a million
    marks a second), and a free slot still holds the last value written to it: a slot is
    cleared as a mark takes it, so a value left there from a cycle before never reads as the
    new mark's, whose wait would end before its work."""
    s = ais.Stream(DEV)
    await s.record_event().synchronize()  # the device's flag memory exists
    ais.delay(3600.0 if FAKE is not None else 1.0, stream=s)  # work that does not end soon
    dev = _backends.get("cuda")._devices.get(0)  # type: ignore[attr-defined]
    flags = dev.watcher.flags
    with dev.lock:
        coming = flags.values % 0xFFFFFFFF + 1  # the value the next mark takes
        for chunk in flags.chunks:
            for j in chunk.free:
                chunk.flags[j] = coming  # as if written there 2**32 - 1 marks ago
    e = s.record_event()
    for strategy in ("poll", "thread", "callback"):
        with anyio.move_on_after(0.02) as scope:
            await e.synchronize(strategy=strategy)
        assert scope.cancelled_caught, strategy  # still waiting: the work has not ended
    assert not e.query()
    hurry()
    with anyio.fail_after(5):
        await e.synchronize()


async def test_a_polled_wait_is_not_held_behind_another_streams(anyio_backend: object) -> None:
    """Polled waits are looked at per stream, the oldest of each first: a wait on a stream
    whose work is done ends while a wait begun before it, on another stream, still waits for
    work that does not end."""
    slow, quick = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(3600.0 if FAKE is not None else 30.0, stream=slow)  # a kernel that does not end
    ais.delay(0.005, stream=quick)
    for _ in range(3):  # the quick stream's capture comes later in its order than the slow one's
        quick.record_event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: slow.synchronize(strategy="poll"))
            with anyio.fail_after(5):
                while not ais.pending_waits():
                    await anyio.sleep(0)
                await quick.synchronize(strategy="poll")
            assert not slow.query()
            tg.cancel_scope.cancel()
    finally:
        hurry()


def test_a_wait_already_complete_is_told_at_once() -> None:
    """``Target.watch`` on a wait whose work has completed calls back before it returns, in the
    calling thread, as the protocol says: whether the wait itself found it complete (a mark, or
    another library's event it queries) or another wait on the same mark did."""
    backend = _backends.get("cuda")
    s = ais.Stream(DEV)
    ais.delay(0.001, stream=s)
    e, owner = s.record_event(), s.record_event()
    foreign = ais.as_event(owner.event_id, DEV)  # recorded elsewhere, as far as it knows
    stream_wait = backend.stream_capture(s._handle, False)
    first, second = (backend.event_capture(e._handle, False) for _ in range(2))
    queried = backend.event_capture(foreign._handle, False)
    targets = (stream_wait, first, queried, second)  # second: its mark is known complete
    try:
        deadline = time.monotonic() + 5
        while not all(target.done() for target in targets[:3]):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for target in targets:
            told: list[int] = []
            target.watch(lambda told=told: told.append(threading.get_ident()))
            assert told == [threading.get_ident()]
    finally:
        for target in targets:
            target.release()


def test_a_semaphore_that_cannot_be_made_says_why() -> None:
    """The watcher's semaphore lives in memory from libc's malloc (size_t sizes): when there
    is none, the OSError carries the C library's errno."""
    import errno

    from aiostream._backends.cuda import watcher

    if watcher.semaphores is None:
        pytest.skip("no POSIX semaphores here: the watcher polls")
    sems = watcher.Semaphores()
    sems.SIZE = (1 << 62) + 64  # more than any machine has (64 bytes, if cut to 32 bits)
    with pytest.raises(OSError) as info:
        sems.new()
    assert info.value.errno == errno.ENOMEM and info.value.strerror == "sem_init failed"
    sems.SIZE = watcher.Semaphores.SIZE
    sem = sems.new()
    assert not sems.wait(sem, 0.001)  # not posted: the timeout ends it
    sems.post(sem)
    assert sems.wait(sem, 1.0)  # posted: returns at once
    # the host function the driver calls is sem_post itself, at that address
    assert sems.post_address
    ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(sems.post_address)(sem)
    assert sems.wait(sem, 1.0)


NO_SEMAPHORES = """
import sys

import anyio

import aiostream as ais
from aiostream._backends.cuda import watcher

watcher.semaphores = None  # as where libc has none: no host function, nothing to post


async def main() -> None:
    s = ais.Stream("cuda:0")
    for strategy in ("hybrid", "thread", "poll", "callback"):
        ais.delay(0.01, stream=s)
        e = s.record_event()
        with anyio.fail_after(10):
            await e.synchronize(strategy=strategy)
        assert e.query()
        await anyio.sleep(0.02)  # the watcher, with nothing to watch, sleeps and looks again
    print("waited", flush=True)


loop = sys.argv[1]
options = {"use_uvloop": True} if loop == "uvloop" else {}
anyio.run(main, backend="trio" if loop == "trio" else "asyncio", backend_options=options)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_without_posix_semaphores_the_watcher_polls_and_every_wait_ends(loop: str) -> None:
    """Where libc has no POSIX semaphores, no host function announces a wait and nothing
    posts the watcher: its thread sleeps its polling intervals (and, with nothing to watch,
    its longest one) and looks again, and a wait of every strategy still ends with its work.
    In a program of its own, which has no semaphores from the start."""
    proc = run_python("-c", NO_SEMAPHORES, loop, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "waited\n"


@needs_stand_in
def test_a_wait_the_watcher_will_look_at_soon_enough_does_not_wake_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new wait posts the watcher's semaphore only if the thread sleeps past when the wait
    needs a look: a second wait, once the thread sleeps toward its next health check
    (``HEALTH_S``) for the first, does not."""
    from aiostream._backends.cuda import watcher

    if watcher.semaphores is None:
        pytest.skip("no POSIX semaphores here: the watcher polls")
    backend = _backends.get("cuda")
    s = ais.Stream(DEV)
    thread = backend._devices[0].watcher
    ais.delay(3600.0, stream=s)
    first, second = s.record_event(), s.record_event()
    posts: list[int] = []
    post = watcher.semaphores.post
    monkeypatch.setattr(watcher.semaphores, "post", lambda sem: (posts.append(sem), post(sem)))
    targets = []
    try:
        targets.append(backend.event_capture(first._handle, True))
        targets[0].watch(lambda: None)
        assert not targets[0].polled
        deadline = time.monotonic() + 5
        # until the thread, woken for the first wait, sleeps again toward its next look
        while not (now := time.monotonic()) < thread.sleeping_until <= now + watcher.HEALTH_S:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        posts.clear()
        targets.append(backend.event_capture(second._handle, True))
        targets[1].watch(lambda: None)
        assert not targets[1].polled and not posts, posts
    finally:
        for target in targets:
            target.release()
        hurry()
    s.synchronize_blocking()


def test_a_failing_completion_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The watcher calls each finished wait's callback (a loop's wake-up) in turn: one that
    raises is logged with its traceback, and the others still run."""
    backend: Any = _backends.get("cuda")
    s = ais.Stream(DEV)
    ais.delay(0.01, stream=s)
    events = [s.record_event(), s.record_event()]
    targets = [backend.event_capture(e._handle, True) for e in events]
    told = threading.Event()

    def fails() -> None:
        raise RuntimeError("a loop already closed")

    try:
        with caplog.at_level(logging.ERROR, logger="aiostream"):
            targets[0].watch(fails)
            targets[1].watch(told.set)
            assert told.wait(5)
            deadline = time.monotonic() + 5
            while not (failed := [r for r in caplog.records if r.exc_info is not None]):
                assert time.monotonic() < deadline, "the failure was not logged"
                time.sleep(0.001)
        assert [r.getMessage() for r in failed] == [
            "aiostream: a wait's completion callback failed"
        ]
        assert "a loop already closed" in str(failed[0].exc_info[1])  # type: ignore[index]
    finally:
        for target in targets:
            target.release()


async def test_cancelled_polled_waits_are_dropped_once_they_outnumber_the_live_ones(
    anyio_backend: object,
) -> None:
    """Polled waits cancelled behind a long one are not kept for the long one's lifetime: once
    there are ``_COMPACT_MIN`` of them, and more than the waits still pending, the waiter
    drops them all at once (a drop per cancel would cost O(n) each)."""
    from aiostream import _waiting

    least = _waiting._COMPACT_MIN
    s = ais.Stream(DEV)
    ais.delay(3600.0 if FAKE is not None else 2.0, stream=s)
    head = s.record_event()  # the long wait's, first in its stream's lane
    events = [s.record_event() for _ in range(least)]
    scopes = [anyio.CancelScope() for _ in events]
    later, later_scope = s.record_event(), anyio.CancelScope()

    async def wait(event: ais.Event, scope: anyio.CancelScope) -> None:
        with scope:
            await event.synchronize(strategy="poll")

    async def pending(n: int) -> None:
        with anyio.fail_after(5):
            while len(ais.pending_waits()) != n:
                await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, head, anyio.CancelScope())
        await pending(1)
        waiter = _waiting._waiter(_backends.get("cuda"), 0)

        def polled() -> int:
            return sum(len(lane) for lane in waiter._lanes.values())  # type: ignore[attr-defined]

        for event, scope in zip(events, scopes, strict=True):
            tg.start_soon(wait, event, scope)
        await pending(1 + least)
        assert polled() == 1 + least
        for scope in scopes[:-1]:
            scope.cancel()
        await pending(2)
        assert polled() == 1 + least  # least - 1 cancelled: kept a while
        scopes[-1].cancel()
        await pending(1)
        assert polled() == 1  # least cancelled, more than the one pending: all dropped
        tg.start_soon(wait, later, later_scope)  # and the count starts again
        await pending(2)
        later_scope.cancel()
        await pending(1)
        assert polled() == 2
        hurry()
    assert s.query()


# ---------------------------------------------------------------------- words that say nothing


@pytest.mark.parametrize("way", ["thread", "callback", "blocking"])
async def test_a_wait_told_to_look_too_early_waits_on(
    anyio_backend: object, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher tells every watched wait to look when the device may have failed; a wait
    that then finds its work neither done nor failed is watched again: it neither returns
    early nor hangs. (Here the watcher's first sweep with a wait tells every wait at once.)"""
    from aiostream._backends.cuda.watcher import Watcher

    sweep = Watcher._sweep
    told: list[int] = []

    def too_early(self: Watcher) -> list[Any]:
        due = sweep(self)
        if not told and self.watched:
            told.append(len(self.watched))
            for target in list(self.watched):
                self._fire(target, due)  # noqa: SLF001 (what the failure path does)
        return due

    monkeypatch.setattr(Watcher, "_sweep", too_early)
    s = ais.Stream(DEV)
    ais.delay(0.3, stream=s)
    with anyio.fail_after(10):
        if way == "blocking":
            await anyio.to_thread.run_sync(s.synchronize_blocking)
        else:
            await s.synchronize(strategy=way)
    assert told == [1]
    assert s.query()  # it waited for the kernel
