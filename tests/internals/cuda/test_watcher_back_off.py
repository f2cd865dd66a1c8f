"""The watcher's back-off while it polls waits no host function announces: a sweep that finds
completions halves the quiet time it backs off from (more may come soon: a burst's waits
end one after another), where it began again from 50 us, which in a burst of thousands of
waits kept it polling every 50-125 us; and after a long quiet it makes the waits young
again, so that the rest of a burst is not left to the quiet's slow polls."""

from __future__ import annotations

import time
from typing import Any

import pytest

import aiostream as ais
from aiostream import _objects
from aiostream._backends.cuda.watcher import YOUNG_S
from tests.helpers.cuda import DEV, device_finishes

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


def _quiet_after_a_find(own_backend: Any, quiet_before: float) -> float:
    """The watcher's quiet time after a sweep that found one completion, ``quiet_before``
    seconds into a quiet."""
    s = ais.Stream(DEV)
    e = s.record_event()
    device_finishes()  # its mark has landed; no sweep has seen it yet (the lock is held)
    watcher = own_backend._devices.get(0).watcher
    told: list[bool] = []
    with watcher.lock:
        target = own_backend.event_target(_objects.handle(e), False)
        target.watch(lambda: told.append(True))
        watcher.progress_at = time.monotonic() - quiet_before
        due = watcher._sweep()
        quiet = time.monotonic() - watcher.progress_at
    assert len(due) == 1
    for callback in due:
        callback()
    assert told == [True]
    target.release()
    return quiet


def test_a_sweep_that_finds_completions_halves_the_back_off(own_backend: Any) -> None:
    quiet = _quiet_after_a_find(own_backend, 0.004)  # quiet for 4 ms: 1 ms polls
    assert 0.0019 <= quiet <= 0.0025, quiet  # halved, not back to 0


def test_a_completion_after_a_long_quiet_makes_the_waits_young_again(own_backend: Any) -> None:
    quiet = _quiet_after_a_find(own_backend, 2.0)  # its polls: up to 50 ms apart
    assert quiet <= YOUNG_S / 2 + 0.001, quiet  # polls up to 2 ms apart again (not 1 s)
