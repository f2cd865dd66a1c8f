"""The simulation's lock-free completion check (``Simulation.settled``), read inside: a race no
test can make happen on demand from outside, so the heap of running work is replaced by one
that empties between two reads.
"""

from __future__ import annotations

from typing import Any

import pytest


def test_a_completion_check_in_doubt_is_not_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """``settled()`` reads the heap of running work without the lock, and another thread may
    empty it between its two reads: in that doubt the answer is "not settled" (the caller
    then takes the lock and brings the simulation to now), never "settled"."""
    from aiostream import _backends

    sim = _backends.get("virtual")._sim  # type: ignore[attr-defined]

    class EmptiedMeanwhile(list):  # type: ignore[type-arg]
        def __bool__(self) -> bool:
            return True  # still work when first asked...

        def __getitem__(self, index: Any) -> Any:
            raise IndexError(index)  # ...and none a moment later

    assert sim.settled()  # nothing running: settled
    monkeypatch.setattr(sim.sched, "running", EmptiedMeanwhile())
    assert sim.settled() is False
