"""Virtual time: ``ais.virtual.Transfer`` completes on the simulator's clock, so a pipeline that
mixes device work and transfers gives the same exact timeline on every run and loop."""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime, run_in_virtual_time
from tests.helpers import virtual_loops

anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio

pytestmark = pytest.mark.anyio


async def _pipeline() -> list[tuple[str, float]]:
    """Fetch three shards over the network (0.25 s each, two at a time) while the device
    computes on the ones already fetched (0.1 s each, on one stream)."""
    stream = ais.Stream()
    log: list[tuple[str, float]] = []
    limit = anyio.Semaphore(2)

    async def shard(i: int) -> None:
        async with limit:
            await ais.wait(ais.virtual.Transfer(0.25, name=f"shard {i}"))
        log.append(("fetched", ais.virtual.now()))
        ais.delay(0.1, stream=stream)
        await ais.wait(stream.record_event())
        log.append(("computed", ais.virtual.now()))

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(shard, i)
    return sorted(log, key=lambda entry: (entry[1], entry[0]))


# which shard goes first is the loop's choice (trio shuffles its ready tasks); when is not
EXPECTED = [
    ("fetched", 0.25),
    ("fetched", 0.25),
    ("computed", 0.35),
    ("computed", 0.45),
    ("fetched", 0.5),
    ("computed", 0.6),
]


async def test_a_pipeline_of_transfers_and_device_work_is_exact(virtual_time: VirtualTime) -> None:
    assert await _pipeline() == EXPECTED
    assert virtual_time.now() == 0.6


def test_the_same_pipeline_outside_pytest_gives_the_same_timeline() -> None:
    for backend in ("asyncio", "trio"):
        assert run_in_virtual_time(_pipeline, backend=backend) == EXPECTED


async def test_a_failed_transfer_raises_its_error_at_its_end(virtual_time: VirtualTime) -> None:
    with pytest.raises(ConnectionResetError):
        await ais.wait(ais.virtual.Transfer(0.5, error=ConnectionResetError("peer gone")))
    assert virtual_time.now() == 0.5


async def test_a_transfer_is_listed_while_pending(virtual_time: VirtualTime) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: ais.wait(ais.virtual.Transfer(1.0, name="weights")))
        await anyio.sleep(0.25)
        [wait] = ais.pending_waits()
        tg.cancel_scope.cancel()
    assert wait.subject == "weights ending at 1.000000000 s"
    assert wait.device == "virtual.transfer"


class _At:
    """Done once the loop's (virtual) clock reaches ``at``."""

    def __init__(self, at: float) -> None:
        self.at = at

    def done(self) -> bool:
        return anyio.current_time() >= self.at


async def _lateness(after: float) -> float:
    """How late the poller sees a handle done ``after`` seconds after another one's completion
    (both waited on from the start, 10 ms before the first is done)."""
    start = anyio.current_time()
    first, second = _At(start + 0.01), _At(start + 0.01 + after)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ais.wait, first)
        await ais.wait(second)
        return anyio.current_time() - second.at


async def test_a_polled_handle_is_seen_within_half_the_time_since_the_last(
    virtual_time: VirtualTime,
) -> None:
    """docs/completions.md: after a completion the poller asks every millisecond, then after
    half the time since the last completion, so a handle done some time after the last
    completion is seen at most a millisecond plus half that time late (these 40: up to 0.47;
    paced by the whole time since, up to 0.69)."""
    afters = [0.004 + 0.0037 * i for i in range(40)]  # 4 to 148 ms, at every phase of the pace
    lates = [await _lateness(after) for after in afters]
    assert min(lates) >= 0.0
    worst = max((late - 0.001) / after for late, after in zip(lates, afters, strict=True))
    assert worst <= 0.5, worst


def _burst(count: int, start: float) -> list[_At]:
    """``count`` handles done 4 ms apart from ``start`` on."""
    return [_At(start + 0.004 * i) for i in range(count)]


async def _seen_late(burst: list[_At], last: _At) -> float:
    """Wait on ``burst`` and ``last`` from now on; return how late ``last`` is seen."""
    async with anyio.create_task_group() as tg:
        for handle in burst:
            tg.start_soon(ais.wait, handle)
        await ais.wait(last)
        return anyio.current_time() - last.at


async def _overdue_lateness(after: float) -> float:
    """How late the poller sees a handle done ``after`` seconds after the last of 20 that
    completed 4 ms apart (all waited on from the start)."""
    steady = _burst(20, anyio.current_time() + 0.01)
    return await _seen_late(steady, _At(steady[-1].at + after))


async def test_a_handle_overdue_at_a_steady_rate_is_seen_at_that_rate(
    virtual_time: VirtualTime,
) -> None:
    """docs/completions.md: while the next completion is due (up to 8 times the usual time
    between completions), the poller asks at least every half of that time, however long
    since the last: with completions 4 ms apart, a handle done 10 to 30 ms after the last is
    seen within 2 ms (paced by half the time since, up to 11 ms late)."""
    afters = [0.010 + 0.0013 * i for i in range(16)]  # at every phase of a 2 ms pace
    lates = [await _overdue_lateness(after) for after in afters]
    assert min(lates) >= 0.0
    assert max(lates) <= 0.002 + 1e-9, max(lates)


class _Counted(_At):
    """Done at ``at``; counts how often it is asked from ``since`` on."""

    def __init__(self, at: float, since: float) -> None:
        super().__init__(at)
        self.since = since
        self.asked = 0

    def done(self) -> bool:
        self.asked += anyio.current_time() > self.since
        return super().done()


async def test_the_rate_s_pace_gives_way_once_completions_stop(virtual_time: VirtualTime) -> None:
    """Past 8 times the usual time between completions, the pace backs off as before: a
    handle done 1 s after the last of 20 completed 4 ms apart is asked 40 times in that second
    (31 paced by half the time since alone), not the 500 of a 2 ms pace kept up."""
    steady = _burst(20, anyio.current_time() + 0.01)
    late = _Counted(steady[-1].at + 1.0, since=steady[-1].at)
    await _seen_late(steady, late)
    assert 20 <= late.asked <= 60, late.asked


async def test_handles_done_at_one_moment_are_all_seen_by_one_sweep(
    virtual_time: VirtualTime,
) -> None:
    """One sweep asks every pending handle: 20 done at one moment are seen at one moment."""
    at = anyio.current_time() + 0.01
    seen: list[float] = []

    async def one() -> None:
        await ais.wait(_At(at))
        seen.append(anyio.current_time())

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(one)
    assert len(seen) == 20
    assert max(seen) == min(seen) >= at


async def _after_bursts(second: int, *, busy: bool, after: float) -> float:
    """How late a handle done ``after`` seconds after the last of two bursts (20, then
    ``second`` completions 4 ms apart) is seen, the bursts 2 s apart, the poller asking
    another handle meanwhile (``busy``) or resting (no wait pending)."""
    start = anyio.current_time() + 0.01
    async with anyio.create_task_group() as tg:
        for handle in _burst(20, start):
            tg.start_soon(ais.wait, handle)
        if busy:
            tg.start_soon(ais.wait, _At(start + 1.0))
    await anyio.sleep(2.0 - (anyio.current_time() - start))
    burst = _burst(second, anyio.current_time())
    return await _seen_late(burst, _At(burst[-1].at + after))


AFTERS = [0.010 + 0.0011 * i for i in range(7)]  # 10 to 17 ms: at every phase of a 2 ms pace


async def test_a_pause_the_poller_waited_through_hardly_slows_the_next_burst_s_pace(
    virtual_time: VirtualTime,
) -> None:
    """A pause counts as 8 usual gaps at most in the poller's average: after the next 20
    completions 4 ms apart, a handle overdue is seen within 2.1 ms (1.67; 3.56 if the pause
    counted whole)."""
    lates = [await _after_bursts(20, busy=True, after=after) for after in AFTERS]
    assert max(lates) <= 0.0021, max(lates)


async def test_a_burst_after_the_poller_rested_keeps_the_last_burst_s_pace(
    virtual_time: VirtualTime,
) -> None:
    """The time while no wait pended is no gap between completions: two completions into the
    next burst, a handle overdue is seen within 2.1 ms (1.70; 4.44 if the rest counted)."""
    lates = [await _after_bursts(2, busy=False, after=after) for after in AFTERS]
    assert max(lates) <= 0.0021, max(lates)
