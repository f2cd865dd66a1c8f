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
