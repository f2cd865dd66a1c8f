"""Behaviours README.md and docs/architecture.md state, each held to its word.

The modules' own files test their details; these are the promises made at the README's level:
what a wait does to the rest of the program, how the virtual device's clocks reach host
functions, debug mode from the environment, and the waiter's life.
"""

from __future__ import annotations

import textwrap

import anyio
import anyio.lowlevel
import pytest

import aiostream as ais
from aiostream import _waiting
from aiostream.virtual import VirtualClock
from tests.helpers.process import run_python

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------- a wait's reach


async def test_a_wait_suspends_only_the_calling_task() -> None:
    """README, first line: the loop runs other tasks, turn after turn, while one awaits."""
    s = ais.Stream()
    ais.delay(0.05, stream=s)
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        with anyio.fail_after(60):
            await s.synchronize()
        assert s.query()
        done = True
    # 50 ms of waiting: a loop held by the wait would have let the other task run once or twice
    assert turns >= 20, turns


async def test_a_wait_on_complete_work_is_one_checkpoint(clock: VirtualClock) -> None:
    """Complete already: no waiter is made, yet the await is a checkpoint, where a pending
    cancellation is delivered."""
    s = ais.Stream()
    e = s.record_event()
    for complete in (e, s):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await complete.synchronize()
            pytest.fail("a cancelled scope's checkpoint raises")  # pragma: no cover
        assert scope.cancelled_caught
    with pytest.raises(LookupError):
        _waiting._waiters.get()  # no waiter was needed


async def test_one_waiter_per_loop_and_device_gone_when_nothing_is_pending(
    clock: VirtualClock,
) -> None:
    ais.virtual.reset(devices=2, clock=clock)
    streams = [ais.Stream("virtual:0"), ais.Stream("virtual:0"), ais.Stream("virtual:1")]
    for s in streams:
        ais.delay(1.0, stream=s)
    async with anyio.create_task_group() as tg:
        for s in streams:
            tg.start_soon(s.synchronize)
        await anyio.wait_all_tasks_blocked()
        waiters = _waiting._waiters.get()
        # one per device, each watching all of that device's waits
        assert sorted((index, w._pending) for (_, index), w in waiters.items()) == [(0, 2), (1, 1)]
        assert ais.virtual.stats().waits == 3
        clock.advance(2.0)  # one compute slot each: device 0 runs its two delays in turn
    await anyio.wait_all_tasks_blocked()
    assert _waiting._waiters.get() == {}  # each left once nothing was pending


# ---------------------------------------------------------------------- host functions and clocks


def test_a_host_function_on_a_callable_clock_runs_at_the_first_call_after_its_end() -> None:
    """On the monotonic or a callable clock the device is lazy: a host function runs in the
    first call into aiostream (a wait, a query) after its operation's end, not before, and
    the operation ends at its own instant whenever that call comes."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    ran_at: list[float] = []
    s = ais.Stream()
    ais.virtual.submit(s, 0.5, engine="h2d", name="upload", fn=lambda: ran_at.append(now[0]))
    now[0] = 0.4
    assert s.query() is False and ran_at == []
    now[0] = 3.0  # past the end; nothing has looked
    assert ran_at == []
    assert s.query() is True
    assert ran_at == [3.0]  # run by the query, at its reading of the clock
    assert [(r.name, r.start, r.end) for r in ais.virtual.timeline()] == [("upload", 0.0, 0.5)]
    s.query()
    assert ran_at == [3.0]  # once


async def test_a_callable_clock_advanced_from_a_task_resumes_waits(anyio_backend: object) -> None:
    """A clock callable that a task moves (a fake-time loop's clock, say): awaits resume at
    the next call into aiostream after the work's end, here another task's query."""
    now = [0.0]
    ais.virtual.reset(clock=lambda: now[0])
    s = ais.Stream()
    ais.delay(10.0, stream=s)
    resumed_at: list[float] = []

    async def waiter() -> None:
        await s.synchronize()
        resumed_at.append(now[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        for step in (2.5, 5.0, 7.5):
            now[0] = step
            assert s.query() is False
            await anyio.wait_all_tasks_blocked()
            assert resumed_at == []
        now[0] = 10.0
        assert s.query() is True
        with anyio.fail_after(5):  # the waiter's own timer is 10 s away
            while not resumed_at:
                await anyio.sleep(0.001)
    assert resumed_at == [10.0]
    assert ais.virtual.stats().waits == 0


# ---------------------------------------------------------------------- debug mode


DEBUG_PROBE = textwrap.dedent(
    """
    import anyio, aiostream as ais

    async def main():
        s = ais.Stream()
        ais.delay(10.0, stream=s)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.synchronize)
            await anyio.wait_all_tasks_blocked()
            (wait,) = ais.pending_waits()
            print("started", wait.started_at is not None)
            print("recorded", wait.recorded_at is not None)
            tg.cancel_scope.cancel()

    anyio.run(main)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("", False), (None, False)])
def test_aiostream_debug_in_the_environment_turns_debug_mode_on(
    value: str | None, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AIOSTREAM_DEBUG=1`` is ``set_debug(True)`` from the start: pending waits say where
    they started and where their work was submitted."""
    monkeypatch.delenv("AIOSTREAM_DEBUG", raising=False)
    env = {} if value is None else {"AIOSTREAM_DEBUG": value}
    result = run_python("-c", DEBUG_PROBE, timeout=120, **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["started", str(on), "recorded", str(on)]
