"""What a CUDA wait captures: an event's wait reads the mark of its record, whatever is
recorded or submitted later; the work of a dropped stream; another library's event, followed
to its latest record; a stream handed out gets no host function of aiostream's; events
recorded on one stream share its lane; a wait already complete is told at once, and a failing
completion callback does not stop the others.

Run where ``cuda:0`` works: on a GPU, and in CI's CUDA lane against the stand-in driver;
tests that count its host functions skip on a GPU.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, held
from tests.helpers.deadlines import deadline, until
from tests.helpers.gate import gate
from tests.helpers.protocol import STRATEGIES, backend, handle_of
from tests.helpers.stand_in import FAKE

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# -------------------------------------------------------- event captures


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
    with deadline(3, "the wait to end with its 0.05 s of work, not the 10 s recorded later"):
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
    with deadline(5, "the wait to end with the dropped stream's work"):
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
        await until(lambda: len(ais.pending_waits()) >= n, f"{n} wait(s) to have begun")

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
        await until(ais.pending_waits, "the wait to begin")
        assert held()["slots"] == base
    assert e.query()
    if FAKE is not None:
        assert FAKE.fake_cuda_host_calls() == calls


async def test_a_wait_on_another_librarys_event_follows_its_latest_record(
    anyio_backend: object,
) -> None:
    """An event aiostream did not record (``as_event``) carries no mark: a wait on it asks the
    driver about the event itself, so a record made meanwhile, which aiostream never sees,
    decides when it ends."""
    busy, idle = ais.Stream(DEV), ais.Stream(DEV)
    release = gate(busy)  # busy's work is held until the test ends
    owner = busy.record_event()
    foreign = ais.as_event(owner.event_id, DEV)
    for strategy in STRATEGIES:
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
            await until(
                lambda finished=finished: finished,
                "the wait on the other library's event to end, once recorded on an idle stream",
            )
        assert not busy.query()
    release()


def test_an_event_recorded_on_a_stream_waits_in_that_stream_s_lane() -> None:
    """Work on one stream completes in order, the records of events on it included: a wait on
    such an event joins the stream's lane (the waiter polls only each lane's head), placed by
    where its record was; a wait on an event that others may record unseen (opened from an
    IPC handle, or whose handle was handed out) has a lane of its own."""
    cuda = backend("cuda")
    s = ais.Stream(DEV)
    recorded = s.record_event()
    exported = ais.Event(DEV, interprocess=True)
    exported.record(s)
    opened = ais.Event.from_ipc_handle(DEV, exported.ipc_handle())  # its record is not ours
    ais.delay(0.001, stream=s)
    targets = [
        cuda.event_target(handle_of(recorded), False),
        cuda.stream_target(handle_of(s), False),
        cuda.event_target(handle_of(opened), False),
        cuda.event_target(handle_of(exported), False),
    ]
    try:
        first, whole, *alone = targets
        assert first.lane == whole.lane and first.seq < whole.seq
        assert [target.lane for target in alone] == [
            ("event", opened.event_id),
            ("event", exported.event_id),
        ]
    finally:
        for target in targets:
            target.release()
    s.synchronize_blocking()


# ---------------------------------------------------------- wait targets


def test_a_wait_already_complete_is_told_at_once() -> None:
    """``Target.watch`` on a wait whose work has completed calls back before it returns, in the
    calling thread, as the protocol says: whether the wait itself found it complete (a mark, or
    another library's event it queries) or another wait on the same mark did."""
    cuda = backend("cuda")
    s = ais.Stream(DEV)
    ais.delay(0.001, stream=s)
    e, owner = s.record_event(), s.record_event()
    foreign = ais.as_event(owner.event_id, DEV)  # recorded elsewhere, as far as it knows
    stream_wait = cuda.stream_target(handle_of(s), False)
    first, second = (cuda.event_target(handle_of(e), False) for _ in range(2))
    queried = cuda.event_target(handle_of(foreign), False)
    targets = (stream_wait, first, queried, second)  # second: its mark is known complete
    try:
        deadline = time.monotonic() + 5
        while not all(target.done() for target in targets[:3]):
            assert time.monotonic() < deadline, "waited 5 s in vain for the work to complete"
            time.sleep(0.001)
        for target in targets:
            told: list[int] = []
            target.watch(lambda told=told: told.append(threading.get_ident()))
            assert told == [threading.get_ident()]
    finally:
        for target in targets:
            target.release()


def test_a_failing_completion_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The watcher calls each finished wait's callback (a loop's wake-up) in turn: one that
    raises is logged with its traceback, and the others still run."""
    cuda: Any = backend("cuda")
    s = ais.Stream(DEV)
    ais.delay(0.01, stream=s)
    events = [s.record_event(), s.record_event()]
    targets = [cuda.event_target(handle_of(e), True) for e in events]
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
