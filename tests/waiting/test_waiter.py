"""The waiter's life: one per event loop and device, started by the first wait that must
suspend (complete work takes the fast path, one checkpoint, and starts none), gone once
nothing is pending; when it fails or is cancelled its waits raise instead of staying parked;
a wake-up that comes after its loop closed is harmless.

The waiter is seen from outside, by what it asks of the backend (tests/helpers/virtual.py).
"""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

import aiostream as ais
from aiostream.virtual import VirtualClock
from tests.helpers.virtual import spy_on_waits

pytestmark = pytest.mark.anyio


async def test_complete_work_takes_the_fast_path(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = spy_on_waits(monkeypatch)
    e = ais.Stream().record_event()
    await e.synchronize()
    # no wait was ever needed: nothing captured, no waiter started
    assert (spy.targets, spy.subscriptions) == (0, [])
    assert ais.virtual.stats().waits == 0


async def test_a_wait_on_complete_work_is_one_checkpoint(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Complete already: no waiter is made, yet the await is a checkpoint, where a pending
    cancellation is delivered."""
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    e = s.record_event()
    for complete in (e, s):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await complete.synchronize()
            pytest.fail("a cancelled scope's checkpoint raises")  # pragma: no cover
        assert scope.cancelled_caught
    assert (spy.targets, spy.subscriptions) == (0, [])  # no waiter was needed


async def test_one_waiter_per_loop_and_device_gone_when_nothing_is_pending(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    ais.virtual.reset(devices=2, clock=clock)
    spy = spy_on_waits(monkeypatch)
    streams = [ais.Stream("virtual:0"), ais.Stream("virtual:0"), ais.Stream("virtual:1")]
    for s in streams:
        ais.delay(1.0, stream=s)
    async with anyio.create_task_group() as tg:
        for s in streams:
            tg.start_soon(s.synchronize)
        await anyio.wait_all_tasks_blocked()
        # one waiter per device, each watching all of that device's waits
        assert sorted(spy.subscriptions) == [0, 1] and spy.running == 2
        waits = sorted(wait.device for wait in ais.pending_waits())
        assert waits == ["virtual:0", "virtual:0", "virtual:1"]
        assert ais.virtual.stats().waits == 3
        clock.advance(2.0)  # one compute slot each: device 0 runs its two delays in turn
    await anyio.wait_all_tasks_blocked()
    assert spy.running == 0  # each left once nothing was pending
    assert len(spy.subscriptions) == 2  # and none started again


async def test_cancelled_waits_are_removed_and_the_waiter_exits(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    events = [s.record_event() for _ in range(200)]
    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(e.synchronize)
        await anyio.wait_all_tasks_blocked()
        assert ais.virtual.stats().waits == 200 == spy.outstanding
        assert spy.running == 1
        tg.cancel_scope.cancel()
    assert ais.virtual.stats().waits == 0 == spy.outstanding
    await anyio.wait_all_tasks_blocked()
    assert (spy.subscriptions, spy.running) == ([0], 0)  # the waiter saw nothing and left
    assert not s.query()  # the device work goes on
    clock.advance(1.0)
    assert s.query()


async def test_a_failed_waiter_fails_its_waits_instead_of_leaving_them_parked(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The waiter's look raises (here the backend's answer to when to wake: a bug on either
    side): the waits it watched raise, saying so, and the waiter is gone."""
    spy = spy_on_waits(monkeypatch)

    def broken(index: int) -> float | None:
        raise RuntimeError("a bug in the waiter's look")

    monkeypatch.setattr(spy.backend, "wake_hint", broken)
    streams = [ais.Stream() for _ in range(3)]
    for s in streams:
        ais.delay(1.0, stream=s)
    errors: list[BaseException] = []

    async def waiter(s: ais.Stream) -> None:
        try:
            await s.synchronize()
        except ais.AiostreamError as exc:
            errors.append(exc)

    with anyio.fail_after(10):  # parked forever would hang here
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(waiter, s)
    assert len(errors) == 3
    for exc in errors:
        assert type(exc) is ais.AiostreamError
        assert str(exc) == (
            "aiostream's waiter failed: RuntimeError(\"a bug in the waiter's look\")"
        )
    logged = [r.getMessage() for r in caplog.records if r.name == "aiostream"]
    assert logged == ["aiostream waiter failed; failing its pending waits"]
    assert ais.virtual.stats().waits == 0
    assert spy.subscriptions and spy.running == 0
    assert not any(s.query() for s in streams)  # the device work goes on


@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)
async def test_a_cancelled_waiter_fails_its_waits(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiter's task cancelled (as a loop shutting down does): its waits raise, saying
    so, instead of staying parked."""
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await s.synchronize()
        except ais.AiostreamError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            (task,) = spy.tasks  # the task that subscribed: the waiter's own
            assert isinstance(task, asyncio.Task)
            task.cancel()
    assert [str(e) for e in errors] == [
        "aiostream's waiter for device 0 was cancelled (is the event loop shutting down?)"
    ] * 2
    assert ais.virtual.stats().waits == 0


def test_a_late_wake_up_after_the_loop_closed_is_harmless(
    clock: VirtualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = spy_on_waits(monkeypatch)
    s = ais.Stream()
    ais.delay(1.0, stream=s)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.synchronize)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()

    asyncio.run(main())
    (wake_up,) = spy.callbacks  # the waiter's, as the backend would call it, late
    wake_up()  # the loop is closed: nothing raises, from the loop's own thread...
    raised: list[BaseException] = []

    def from_another_thread() -> None:
        try:
            wake_up()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    late = threading.Thread(target=from_another_thread)  # ...nor from another
    late.start()
    late.join(10)
    assert not late.is_alive() and raised == []
    clock.advance(1.0)  # no listener left to call
    assert ais.virtual.stats().waits == 0


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed")
        return uvloop.new_event_loop()  # type: ignore[no-any-return]
    return asyncio.new_event_loop()


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])  # trio ends a run's every task
def test_the_waits_of_a_loop_closed_with_them_pending_are_forgotten(
    clock: VirtualClock, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """``loop.close()`` with waits pending leaves their tasks unfinished for good: the waits
    are forgotten (no longer listed, nothing of the backend's held for them), and the
    completion that comes later raises and logs nothing."""
    s = ais.Stream()
    ais.delay(1.0, stream=s)
    loop = _new_loop(kind)
    tasks = [loop.create_task(s.synchronize()) for _ in range(3)]
    loop.run_until_complete(asyncio.sleep(0))
    assert len(ais.pending_waits()) == 3
    loop.close()
    assert ais.pending_waits() == []
    assert ais.virtual.stats().waits == 0
    with caplog.at_level("DEBUG", logger="aiostream"):
        clock.advance(1.0)
    assert caplog.messages == [] and ais.pending_waits() == []
    del tasks  # asyncio's own "Task was destroyed but it is pending!" is the program's
