"""The watcher's back-off while it polls waits no host function announces: a sweep that finds
completions halves the quiet time it backs off from (more may come soon: a burst's waits
end one after another), where it began again from 50 us, which in a burst of thousands of
waits kept it polling every 50-125 us."""

from __future__ import annotations

import time
from typing import Any

import pytest

import aiostream as ais
from aiostream import _objects
from tests.helpers.cuda import DEV, device_finishes

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


def test_a_sweep_that_finds_completions_halves_the_back_off(own_backend: Any) -> None:
    s = ais.Stream(DEV)
    e = s.record_event()
    device_finishes()  # its mark has landed; no sweep has seen it yet (the lock is held)
    watcher = own_backend._devices.get(0).watcher
    told: list[bool] = []
    with watcher.lock:
        target = own_backend.event_target(_objects.handle(e), False)
        target.watch(lambda: told.append(True))
        watcher.progress_at = time.monotonic() - 0.004  # quiet for 4 ms: 1 ms polls
        due = watcher._sweep()
        quiet = time.monotonic() - watcher.progress_at
    assert len(due) == 1
    assert 0.0019 <= quiet <= 0.0025, quiet  # halved, not back to 0
    for callback in due:
        callback()
    assert told == [True]
    target.release()
