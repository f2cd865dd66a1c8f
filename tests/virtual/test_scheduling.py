"""The virtual device's time model: engines and their slots, priorities, stream order and the
dependencies between streams (``wait_event``, ``wait_stream``), deterministic timelines, and
``submit``'s input checked.
"""

from __future__ import annotations

import gc

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock

pytestmark = pytest.mark.anyio


def spans() -> list[tuple[str, int, float, float]]:
    return [(r.name, r.stream, r.start, r.end) for r in ais.virtual.timeline()]


def test_one_engine_slot_serialises_streams_in_submission_order(clock: VirtualClock) -> None:
    a, b = ais.Stream(), ais.Stream()
    ais.virtual.submit(a, 1.0, name="a")
    ais.virtual.submit(b, 1.0, name="b")
    clock.advance(2.0)
    assert spans() == [("a", a.stream_id, 0.0, 1.0), ("b", b.stream_id, 1.0, 2.0)]


def test_engines_overlap_and_slots_add_parallelism() -> None:
    clock = VirtualClock()
    ais.virtual.reset(clock=clock, compute_slots=2)
    a, b, c = ais.Stream(), ais.Stream(), ais.Stream()
    ais.virtual.submit(a, 1.0, name="k1")
    ais.virtual.submit(b, 1.0, name="k2")
    ais.virtual.submit(c, 1.0, engine="h2d", name="copy")
    ais.virtual.submit(c, 1.0, name="k3")  # waits for its stream, then for a compute slot
    clock.advance(3.0)
    assert spans() == [
        ("k1", a.stream_id, 0.0, 1.0),
        ("k2", b.stream_id, 0.0, 1.0),
        ("copy", c.stream_id, 0.0, 1.0),
        ("k3", c.stream_id, 1.0, 2.0),
    ]


def test_higher_priority_stream_takes_the_free_slot_first(clock: VirtualClock) -> None:
    busy, low, high = ais.Stream(), ais.Stream(priority=0), ais.Stream(priority=-3)
    ais.virtual.submit(busy, 1.0, name="busy")
    clock.advance(0.5)
    ais.virtual.submit(low, 1.0, name="low")
    ais.virtual.submit(high, 1.0, name="high")
    clock.advance(3.0)
    assert [(n, s, e) for n, _, s, e in spans()] == [
        ("busy", 0.0, 1.0),
        ("high", 1.0, 2.0),
        ("low", 2.0, 3.0),
    ]


def test_the_default_stream_competes_at_the_default_priority(clock: VirtualClock) -> None:
    """The default stream has priority 0, as a stream made with none given: for a free slot
    it comes before such a stream by stream order alone, after a higher-priority one."""
    busy, other, high = ais.Stream(), ais.Stream(), ais.Stream(priority=-1)
    assert ais.default_stream().priority == other.priority == 0
    ais.virtual.submit(busy, 1.0, name="busy")
    clock.advance(0.5)
    ais.virtual.submit(other, 1.0, name="other")
    ais.virtual.submit(ais.default_stream(), 1.0, name="default")
    ais.virtual.submit(high, 1.0, name="high")
    clock.advance(4.0)
    assert [(n, s) for n, _, s, _ in spans()] == [
        ("busy", 0.0),
        ("high", 1.0),
        ("default", 2.0),
        ("other", 3.0),
    ]


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_submissions_at_one_instant_do_not_depend_on_their_order(
    clock: VirtualClock, order: tuple[int, ...]
) -> None:
    streams = [ais.Stream(), ais.Stream(), ais.Stream(priority=-1)]
    for i in order:
        ais.virtual.submit(streams[i], 1.0, name=f"op{i}")
    clock.advance(3.0)
    # the high-priority stream first, then stream order, whichever task submitted first
    assert [(n, s) for n, _, s, _ in spans()] == [("op2", 0.0), ("op0", 1.0), ("op1", 2.0)]


def test_an_operation_displaced_at_its_start_runs_its_whole_length_later(
    clock: VirtualClock,
) -> None:
    """An operation started at an instant gives its slot to a better one submitted at that
    same instant, and starts again when the slot is free: it runs its whole length from then,
    not to the end first planned for it."""
    low, high = ais.Stream(), ais.Stream(priority=-1)
    ais.virtual.submit(low, 1.0, name="low")  # starts at 0 while nothing else is there
    ais.virtual.submit(high, 0.25, name="high")  # same instant, better: takes the slot
    clock.advance(1.1)  # past the end first planned (1.0)
    assert high.query() and not low.query()
    clock.advance(0.15)
    assert low.query()
    assert [(n, s, e) for n, _, s, e in spans()] == [("high", 0.0, 0.25), ("low", 0.25, 1.25)]


def test_start_waits_for_submission_stream_and_events(clock: VirtualClock) -> None:
    a, b = ais.Stream(), ais.Stream()
    ais.virtual.submit(a, 2.0, engine="h2d", name="upload")
    b.wait_event(a.record_event())
    clock.advance(0.5)
    ais.virtual.submit(b, 1.0, name="kernel")  # submitted at 0.5, ready at 2.0
    ais.virtual.submit(b, 1.0, engine="d2h", name="download")
    clock.advance(5.0)
    assert [(n, s, e) for n, _, s, e in spans()] == [
        ("upload", 0.0, 2.0),
        ("kernel", 2.0, 3.0),
        ("download", 3.0, 4.0),
    ]
    assert spans()[0][1] == a.stream_id


def test_zero_duration_and_records_need_no_slot(clock: VirtualClock) -> None:
    s = ais.Stream()
    ais.virtual.submit(s, 0.0, name="noop")
    assert s.query()
    assert spans() == [("noop", s.stream_id, 0.0, 0.0)]


def test_queued_work_survives_its_stream(clock: VirtualClock) -> None:
    done: list[int] = []
    s = ais.Stream()
    ais.virtual.submit(s, 1.0, fn=lambda: done.append(1))
    del s
    gc.collect()
    clock.advance(1.0)
    assert ais.virtual.stats().operations == 0
    assert done == [1]


def program() -> list[ais.virtual.OpRecord]:
    clock = VirtualClock()
    ais.virtual.reset(clock=clock, compute_slots=2)
    streams = [ais.Stream(priority=-(i % 3)) for i in range(6)]
    for i in range(30):
        s = streams[(i * 7) % 6]
        engine = ais.virtual.ENGINES[i % 3]
        ais.virtual.submit(s, 0.001 * (1 + (i * 13) % 5), engine=engine, name=f"op{i}")
        if i % 4 == 0:
            streams[(i + 1) % 6].wait_stream(s)
        clock.advance(0.0005)
    clock.advance(10.0)
    return ais.virtual.timeline()


def test_same_program_gives_the_same_timeline() -> None:
    first = program()
    assert len(first) == 30
    assert all(
        a.end <= b.start or a.stream != b.stream for a, b in zip(first, first[1:], strict=False)
    )
    for _ in range(3):
        assert program() == first


def test_submit_rejects_bad_input() -> None:
    s = ais.Stream()
    with pytest.raises(TypeError, match="stream must be an aiostream.Stream"):
        ais.virtual.submit("s", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'compute', 'h2d', 'd2h'"):
        ais.virtual.submit(s, 1.0, engine="gpu")
    with pytest.raises(ValueError, match=">= 0"):
        ais.virtual.submit(s, -1.0)
    with pytest.raises(TypeError, match="fn must be callable"):
        ais.virtual.submit(s, 1.0, fn=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="error must be a message"):
        ais.virtual.submit(s, 1.0, error=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name must be a str"):
        ais.virtual.submit(s, 1.0, name=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- waits on other streams


async def test_a_stream_synchronize_covers_an_event_it_waits_on_after_its_work(
    clock: VirtualClock,
) -> None:
    """Cross-stream ordering: ``s.wait_event(e)`` after the last work of ``s`` is part of what
    ``s`` must finish, so ``await s.synchronize()`` and ``s.query()`` wait for ``e`` too."""
    producer, consumer = ais.Stream(), ais.Stream()
    ais.delay(2.0, stream=producer)
    ready = producer.record_event()
    ais.virtual.submit(consumer, 1.0, engine="h2d")  # beside the producer's kernel
    consumer.wait_event(ready)  # after the consumer's own work: no work follows it
    resumed: list[float] = []

    async def waiter() -> None:
        await consumer.synchronize()
        resumed.append(clock.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        clock.advance(1.0)  # the consumer's own work is done; the event it waits on is not
        await anyio.wait_all_tasks_blocked()
        assert resumed == []
        assert consumer.query() is False
        clock.advance(1.0)
    assert resumed == [2.0]
    assert consumer.query() is True
    assert ais.virtual.stats().waits == 0


def test_a_stream_with_no_work_of_its_own_waits_for_the_event_it_waits_on(
    clock: VirtualClock,
) -> None:
    producer, consumer = ais.Stream(), ais.Stream()
    ais.delay(1.0, stream=producer)
    consumer.wait_event(producer.record_event())
    assert consumer.query() is False
    clock.advance(0.5)
    assert consumer.query() is False
    clock.advance(0.5)
    assert consumer.query() is True
