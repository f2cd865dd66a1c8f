"""``await stream`` and ``await event``: the same as awaiting ``synchronize()``, on every
backend and loop; ``query()`` stays a plain bool."""

from __future__ import annotations

import inspect

import anyio
import pytest

import aiostream as ais
from tests.helpers.deadlines import deadline

pytestmark = pytest.mark.anyio

SHORT = 0.02  # seconds of device work: pending when awaited, quick to finish
#: seconds of device work a query made at once still finds pending, on a loaded machine too
PENDING = 0.2
#: seconds of device work still pending after a short wait: wide margin for a loaded machine
LONG = 0.5


async def test_await_a_stream_waits_for_all_its_work(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=s)
    ais.delay(PENDING, stream=s)
    assert s.query() is False
    await s
    assert s.query() is True


async def test_await_an_event_waits_for_what_it_captured(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(SHORT, stream=s)
    e = s.record_event()
    ais.delay(LONG, stream=s)  # after the record: not the event's work
    with deadline(10, "the event's own work"):
        await e
    assert e.query() is True
    assert s.query() is False  # the await did not wait for the work recorded after it
    await s


async def test_await_raises_the_device_error(aiostream_device: ais.Device) -> None:
    if aiostream_device.type != "virtual":
        pytest.skip("faults are injected on virtual devices")
    s = ais.Stream(aiostream_device)
    ais.virtual.submit(s, SHORT, error="boom")
    with pytest.raises(ais.DeviceError, match="boom"):
        await s


async def test_await_uses_the_default_strategy(
    aiostream_device: ais.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str | None] = []
    original = ais.Event.synchronize

    async def spy(self: ais.Event, *, strategy: str | None = None) -> None:
        seen.append(strategy)
        await original(self, strategy=strategy)

    monkeypatch.setattr(ais.Event, "synchronize", spy)
    e = ais.Stream(aiostream_device).record_event()
    await e
    assert seen == [None]


async def test_await_is_cancellable(aiostream_device: ais.Device) -> None:
    s = ais.Stream(aiostream_device)
    ais.delay(LONG, stream=s)
    with anyio.move_on_after(0.05) as scope:
        await s
    assert scope.cancelled_caught
    assert ais.pending_waits() == []
    await s


def test_streams_and_events_are_awaitable_but_query_is_a_bool() -> None:
    s = ais.Stream()
    e = ais.Event()
    assert inspect.isawaitable(s) and inspect.isawaitable(e)
    assert s.query() is True and e.query() is True  # a bool, never an awaitable
    assert not inspect.isawaitable(s.query())
