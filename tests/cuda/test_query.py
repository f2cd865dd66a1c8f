"""``query()`` reports the program's work, not aiostream's own: a stream whose last work is an
event's record, followed by aiostream's completion mark, is idle once that event has completed,
however late the device writes the mark (the stand-in delays it here); PyTorch's
``test_stream_event_nogil`` pattern (synchronize the last event recorded, then the stream is
idle) holds, and so does a stream another waited on through ``wait_stream``."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import aiostream as ais
from tests.helpers.cuda import DEV
from tests.helpers.deadlines import until
from tests.helpers.stand_in import FAKE, needs_stand_in

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract"), needs_stand_in]

LATE = 0.05  # seconds the device takes to write each of aiostream's marks


@pytest.fixture
def late_marks() -> Iterator[None]:
    FAKE.fake_cuda_write_delay(round(LATE * 1e9))
    try:
        yield
    finally:
        FAKE.fake_cuda_write_delay(0)


@pytest.mark.usefixtures("late_marks")
@pytest.mark.parametrize("strategy", ["hybrid", "poll", "thread", "callback"])
async def test_a_stream_is_idle_once_its_last_record_completed(
    anyio_backend: object, strategy: str
) -> None:
    ais.set_wait_strategy(strategy)
    s = ais.Stream(DEV)
    for _ in range(3):
        ais.delay(0.001, stream=s)
        e = s.record_event()
        await until(e.query, "the record to complete (its mark lands 50 ms later)")
        assert s.query()  # the mark after the record is still to land: not the user's work
        await e
        assert s.query()
    ais.delay(0.2, stream=s)  # and work after the record is the user's again
    assert not s.query()
    await s


@pytest.mark.usefixtures("late_marks")
async def test_a_stream_waited_on_is_idle_once_the_waiter_is_done(anyio_backend: object) -> None:
    """``b.wait_stream(a)`` records an event on ``a`` that the program never holds: ``a`` is
    idle once ``b``'s work after the wait has completed (PyTorch's multi-stream pattern)."""
    a, b = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(0.001, stream=a)
    b.wait_stream(a)
    gc.collect()  # the event of the wait is dropped: its handle is kept for a's idle check
    await b.record_event()
    assert a.query()
    ais.delay(0.001, stream=a)  # a records again: the kept handle goes
    a.record_event()
    await a
    assert a.query()
