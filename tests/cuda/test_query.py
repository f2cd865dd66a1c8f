"""``query()`` reports the program's work, not aiostream's own: a stream whose last work is an
event's record, followed by aiostream's completion mark, is idle once that event has completed,
however late the device writes the mark; PyTorch's ``test_stream_event_nogil`` pattern
(synchronize the last event recorded, then the stream is idle) holds, and so does a stream
another waited on through ``wait_stream``.

The marks are made late on any driver (``late_marks``): each of aiostream's mark writes on the
stream (``cuStreamWriteValue32``, a stream memory operation) is held behind a gate
(``tests/helpers/gate.py``) enqueued right before it, at the bindings, which aiostream calls;
the moment a GPU leaves between a record and its mark then lasts until the test lets it go.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import aiostream as ais
from tests.helpers.cuda import DEV
from tests.helpers.deadlines import until
from tests.helpers.gate import gate, gated
from tests.helpers.protocol import STRATEGIES

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


@dataclass
class _Handle:
    """What ``gate()`` reads of a stream, for one aiostream writes a mark on."""

    stream_id: int
    device_index: int = 0
    device_type: str = "cuda"


@contextlib.contextmanager
def late_marks(stream: ais.Stream) -> Iterator[list[Any]]:
    """The marks aiostream writes on ``stream`` during the block land only at its exit (or
    when the test calls the releases it gets, one for each mark held): a gate goes on the
    stream right before each."""
    from cuda.bindings import driver

    real = driver.cuStreamWriteValue32
    releases: list[Any] = []

    def write(handle: Any, *args: Any) -> Any:
        frame = inspect.currentframe()
        caller = str(frame.f_back.f_globals.get("__name__", "")) if frame and frame.f_back else ""
        if caller.startswith("aiostream") and int(handle) == stream.stream_id:
            releases.append(gate(_Handle(stream.stream_id, stream.device_index)))  # type: ignore[arg-type]
        return real(handle, *args)

    driver.cuStreamWriteValue32 = write
    try:
        yield releases
    finally:
        driver.cuStreamWriteValue32 = real
        for release in releases:
            release()


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_a_stream_is_idle_once_its_last_record_completed(
    anyio_backend: object, strategy: str
) -> None:
    ais.set_wait_strategy(strategy)
    s = ais.Stream(DEV)
    for _ in range(3):
        ais.delay(0.001, stream=s)
        with late_marks(s) as held:
            e = s.record_event()
            assert len(held) == 1  # the record's mark
            await until(e.query, "the record to complete (its mark lands later)")
            assert s.query()  # the mark after the record is still to land: not the user's work
        await e
        assert s.query()
    with gated(s):  # and work after the record is the user's again
        ais.delay(0.001, stream=s)
        assert not s.query()
    await s
    assert s.query()


async def test_a_stream_waited_on_is_idle_once_the_waiter_is_done(anyio_backend: object) -> None:
    """``b.wait_stream(a)`` records an event on ``a`` that the program never holds: ``a`` is
    idle once ``b``'s work after the wait has completed (PyTorch's multi-stream pattern)."""
    a, b = ais.Stream(DEV), ais.Stream(DEV)
    ais.delay(0.001, stream=a)
    with late_marks(a) as held:
        b.wait_stream(a)
        assert len(held) == 1  # the mark after the record on a
        gc.collect()  # the event of the wait is dropped: its handle is kept for a's idle check
        await b.record_event()
        assert a.query()
    ais.delay(0.001, stream=a)  # a records again: the kept handle goes
    a.record_event()
    await a
    assert a.query()
