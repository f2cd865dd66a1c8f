"""Wait strategies (README, "Waiting"): chosen for every loop by ``set_wait_strategy`` or
``AIOSTREAM_WAIT_STRATEGY``, or for one wait by ``synchronize(strategy=...)``; checked even
where no wait is needed; and the virtual device, which knows when its work completes, waits
for that moment whatever the strategy.

How each strategy watches a wait runs on CUDA (tests/cuda/) and, without a driver, against a
fake backend (tests/internals/waiting/test_strategy_waiter.py).
"""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais

pytestmark = pytest.mark.anyio


def test_the_wait_strategy_is_chosen_globally_or_by_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIOSTREAM_WAIT_STRATEGY", raising=False)
    assert ais.get_wait_strategy() == "quiet"  # no host function unless chosen
    monkeypatch.setenv("AIOSTREAM_WAIT_STRATEGY", "thread")
    assert ais.get_wait_strategy() == "thread"
    ais.set_wait_strategy("poll")
    try:
        assert ais.get_wait_strategy() == "poll"  # the call wins over the environment
    finally:
        ais.set_wait_strategy(None)
    assert ais.get_wait_strategy() == "thread"
    monkeypatch.setenv("AIOSTREAM_WAIT_STRATEGY", "spin")
    with pytest.raises(ValueError, match="AIOSTREAM_WAIT_STRATEGY='spin' is not a wait strategy"):
        ais.get_wait_strategy()
    with pytest.raises(ValueError, match="'quiet', 'hybrid', 'poll', 'thread', 'callback'"):
        ais.set_wait_strategy("spin")
    with pytest.raises(TypeError, match="strategy must be a str"):
        ais.set_wait_strategy(1)  # type: ignore[arg-type]


async def test_a_bad_strategy_is_refused_even_on_the_fast_path(anyio_backend: object) -> None:
    s = ais.Stream()
    with pytest.raises(ValueError, match="strategy must be one of"):
        await s.synchronize(strategy="busy")
    with pytest.raises(TypeError, match="strategy must be a str"):
        await s.record_event().synchronize(strategy=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["hybrid", "poll", "thread", "callback", "quiet"])
async def test_virtual_waits_take_any_strategy_and_sleep_until_completion(
    clock: ais.virtual.VirtualClock, anyio_backend: object, strategy: str
) -> None:
    """The virtual backend knows when work completes: every strategy waits on that moment."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    e = s.record_event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: e.synchronize(strategy=strategy))
        await anyio.wait_all_tasks_blocked()
        assert not e.query()
        clock.advance(1.0)
    assert e.query()
