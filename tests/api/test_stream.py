"""Streams: properties, identity, the current stream, and bad input."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import anyio
import pytest

import aiostream as ais

pytestmark = pytest.mark.anyio


def test_properties_and_repr() -> None:
    s = ais.Stream("virtual:0", priority=-2)
    assert s.device == ais.Device("virtual", 0)
    assert s.device_type == "virtual"
    assert s.device_index == 0
    assert s.priority == -2
    assert s.stream_id > 0
    assert repr(s) == f"<aiostream.Stream device=virtual:0 id={s.stream_id} priority=-2>"


def test_stream_ids_are_unique_per_device() -> None:
    streams = [ais.Stream() for _ in range(5)]
    assert len({s.stream_id for s in streams}) == 5
    assert ais.default_stream().stream_id not in {s.stream_id for s in streams}


def test_equality_and_hash_by_device_and_id() -> None:
    a, b = ais.Stream(), ais.Stream()
    assert a == a and a != b
    assert a != object()
    assert len({a, b, a}) == 2
    assert ais.default_stream() == ais.default_stream()
    assert hash(ais.default_stream()) == hash(ais.default_stream())


@pytest.mark.parametrize("priority", [1, -6])
def test_priority_out_of_range_names_the_range(priority: int) -> None:
    with pytest.raises(ValueError, match=r"between -5 \(highest\) and 0 \(lowest\)"):
        ais.Stream(priority=priority)


@pytest.mark.parametrize("priority", [0.5, "0", None, True])
def test_priority_must_be_an_int(priority: object) -> None:
    with pytest.raises(TypeError, match="priority must be an int"):
        ais.Stream(priority=priority)  # type: ignore[arg-type]


def test_a_named_stream_carries_its_name_where_it_is_shown(tmp_path: Path) -> None:
    s = ais.Stream(name="loader")
    assert s.name == "loader"
    assert (
        repr(s) == f"<aiostream.Stream device=virtual:0 id={s.stream_id} priority=0 name='loader'>"
    )
    plain = ais.Stream()
    assert plain.name is None
    assert repr(plain) == f"<aiostream.Stream device=virtual:0 id={plain.stream_id} priority=0>"
    with ais.profile() as prof:  # what traces and timelines show: the name, if it has one
        for stream in (s, plain):
            ais.delay(0.0, stream=stream)
            stream.synchronize_blocking()
    prof.export_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] > 1}
    assert lanes == {
        f"virtual:0 stream {s.stream_id} (loader)",
        f"virtual:0 stream {plain.stream_id}",
    }
    with pytest.raises(TypeError) as caught:
        ais.Stream(name=1)  # type: ignore[arg-type]
    assert str(caught.value) == "name must be a str or None, got 1"


def test_the_default_stream_has_priority_0_and_no_name_on_each_device() -> None:
    ais.virtual.reset(devices=2)
    for index in (0, 1):
        d = ais.default_stream(f"virtual:{index}")
        assert d.device == ais.Device("virtual", index)
        assert (d.stream_id, d.priority, d.name) == (0, 0, None)
        assert repr(d) == f"<aiostream.Stream device=virtual:{index} id=0 priority=0>"
        assert ais.default_stream(f"virtual:{index}") is d


def test_a_backend_a_reset_replaced_is_not_kept_alive_by_its_default_stream() -> None:
    """A program (or the pytest plugin, once a test) that resets the virtual device gets the
    memory of the backend it replaced back, though it asked for that one's default stream."""
    old = weakref.ref(ais.default_stream("virtual:0"))
    ais.virtual.reset()
    assert ais.default_stream("virtual:0") is not old()
    gc.collect()
    assert old() is None


def test_delay_checks_its_seconds() -> None:
    with pytest.raises(TypeError) as caught:
        ais.delay("1")  # type: ignore[arg-type]
    assert str(caught.value) == "seconds must be a number (int or float), got '1'"
    with pytest.raises(ValueError) as wrong:
        ais.delay(-1.0)
    assert str(wrong.value) == "seconds must be a finite number >= 0, got -1.0"


def test_default_and_current_stream() -> None:
    d = ais.default_stream()
    assert d.stream_id == 0
    assert ais.default_stream("virtual:0") is d
    assert ais.current_stream() is d
    s = ais.Stream()
    with ais.use_stream(s) as used:
        assert used is s
        assert ais.current_stream() is s
        inner = ais.Stream()
        with ais.use_stream(inner):
            assert ais.current_stream() is inner
        assert ais.current_stream() is s
    assert ais.current_stream() is d


def test_use_stream_is_per_device() -> None:
    ais.virtual.reset(devices=2)
    s1 = ais.Stream("virtual:1")
    with ais.use_stream(s1):
        assert ais.current_stream("virtual:1") is s1
        assert ais.current_stream("virtual:0") is ais.default_stream("virtual:0")


def test_use_stream_rejects_non_streams() -> None:
    with pytest.raises(TypeError, match="needs an aiostream.Stream"):
        with ais.use_stream("virtual:0"):  # type: ignore[arg-type]
            pass


async def test_current_stream_is_task_local() -> None:
    seen: dict[int, ais.Stream] = {}
    streams = {i: ais.Stream() for i in range(2)}
    both_inside = anyio.Event()
    inside = 0

    async def task(i: int) -> None:
        nonlocal inside
        with ais.use_stream(streams[i]):
            inside += 1
            if inside == 2:
                both_inside.set()
            await both_inside.wait()  # both tasks hold their own setting at once
            seen[i] = ais.current_stream()

    async with anyio.create_task_group() as tg:
        tg.start_soon(task, 0)
        tg.start_soon(task, 1)
    assert seen == streams
    assert ais.current_stream() is ais.default_stream()


def test_record_event_returns_the_event_it_recorded() -> None:
    s = ais.Stream()
    e = ais.Event()
    assert s.record_event(e) is e
    assert e.event_id != 0
    new = s.record_event()
    assert isinstance(new, ais.Event) and new is not e and new.event_id != 0


def test_bad_arguments_to_stream_methods() -> None:
    s = ais.Stream()
    with pytest.raises(TypeError, match="event must be an aiostream.Event"):
        s.wait_event(s)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        s.wait_stream(ais.Event())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="event must be an aiostream.Event or None"):
        s.record_event("e")  # type: ignore[arg-type]


def test_streams_of_different_devices_can_wait_on_each_other(
    clock: ais.virtual.VirtualClock,
) -> None:
    ais.virtual.reset(devices=2, clock=clock)
    a, b = ais.Stream("virtual:0"), ais.Stream("virtual:1")
    ais.delay(1.0, stream=a)
    b.wait_stream(a)
    ais.delay(1.0, stream=b)
    clock.advance(1.5)
    assert a.query() and not b.query()
    clock.advance(0.5)
    assert b.query()


@pytest.mark.parametrize(
    ("seconds", "exc"),
    [
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_delay_rejects_bad_durations(seconds: object, exc: type) -> None:
    with pytest.raises(exc, match="seconds"):
        ais.delay(seconds)  # type: ignore[arg-type]


def test_delay_rejects_non_streams() -> None:
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream or None"):
        ais.delay(0.1, stream="virtual:0")  # type: ignore[arg-type]


def test_delay_goes_to_the_current_stream(clock: ais.virtual.VirtualClock) -> None:
    s = ais.Stream()
    with ais.use_stream(s):
        ais.delay(1.0)
    assert not s.query()
    assert ais.default_stream().query()
    clock.advance(1.0)
    assert s.query()
