"""A graph's replays in flight, white-box: ``Graph.replay`` keeps an event after each replay
(the buffers its copies use live until they complete), forgets those complete from the oldest
of the replay's stream, and never queries every replay still in flight: a replay's cost is
flat in their number. Counted on a virtual device whose clock does not move."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import aiostream as ais
from aiostream import _backends


@pytest.fixture
def clock() -> Iterator[ais.virtual.VirtualClock]:
    """A virtual device whose clock moves only when the test says."""
    manual = ais.virtual.VirtualClock()
    ais.virtual.reset(clock=manual)
    yield manual
    ais.virtual.reset()


@pytest.fixture
def queries(monkeypatch: pytest.MonkeyPatch, clock: Any) -> list[Any]:
    """The events the virtual backend is asked about."""
    backend = _backends.get("virtual")
    asked: list[Any] = []
    query = backend.event_query

    def counted(event: Any, quick: bool = False) -> bool:
        asked.append(event)
        return query(event, quick)

    monkeypatch.setattr(backend, "event_query", counted)
    return asked


def _graph() -> ais.Graph:
    g = ais.Graph("virtual:0", name="step")
    with g.capture() as s:
        ais.delay(0.001, stream=s)
    return g


def test_a_replay_looks_at_one_replay_in_flight_at_most(queries: list[Any]) -> None:
    g = _graph()
    s = ais.Stream("virtual:0")
    for _ in range(1000):
        g.replay(s)
    queries.clear()
    for _ in range(100):
        g.replay(s)
    assert len(queries) <= 100, len(queries)  # the oldest pending, once a replay
    g.close()


def test_replays_complete_are_forgotten_from_the_oldest(
    queries: list[Any], clock: ais.virtual.VirtualClock
) -> None:
    """Once replays complete, a replay forgets them all (each looked at once), and the graph
    keeps trackers only for those still in flight; replays on other streams are tracked
    apart."""
    g = _graph()
    s, t = ais.Stream("virtual:0"), ais.Stream("virtual:0")
    for _ in range(200):
        g.replay(s)
    g.replay(t)
    clock.advance(1.0)  # all 200 ran
    for _ in range(100):
        g.replay(s)
    trackers = {stream: len(kept) for stream, kept in g._last.items()}  # noqa: SLF001
    assert trackers == {s.stream_id: 100, t.stream_id: 1}, trackers
    g.close()
