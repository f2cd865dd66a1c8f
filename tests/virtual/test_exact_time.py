"""Virtual time is exact: the fixture's clock and the virtual device read the same integer
nanoseconds, however the loop's float clock rounds."""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from aiostream.testing import VirtualTime, run_in_virtual_time
from aiostream.virtual import VirtualClock

pytestmark = pytest.mark.anyio


async def test_three_device_waits_of_a_tenth_make_three_tenths(virtual_time: VirtualTime) -> None:
    s = ais.Stream()
    for _ in range(3):
        ais.delay(0.1, stream=s)
        await s
    assert virtual_time.now() == 0.3 == ais.virtual.now()
    assert virtual_time.now_ns() == 300_000_000


async def test_three_loop_sleeps_of_a_tenth_make_three_tenths(virtual_time: VirtualTime) -> None:
    for _ in range(3):
        await anyio.sleep(0.1)  # the loop's clock sums floats: 0.30000000000000004
    assert virtual_time.now() == 0.3
    assert virtual_time.now_ns() == 300_000_000


def test_run_in_virtual_time_is_exact_too() -> None:
    async def tenths() -> float:
        for _ in range(3):
            await anyio.sleep(0.1)
        ais.delay(0.1)
        await ais.current_stream()
        return ais.virtual.now()

    assert run_in_virtual_time(tenths) == 0.4
    assert run_in_virtual_time(tenths, backend="trio") == 0.4


@pytest.mark.timeout(20)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_timers_past_two_to_the_24_seconds_fire(backend: str) -> None:
    """Past 2**24 s a float cannot hold now plus asyncio's clock resolution: its timers
    still fire, those due at once included, and device work ends there too."""
    far = 2.0**24 + 1

    async def far_away() -> tuple[float, float]:
        await anyio.sleep(far)
        slept = ais.virtual.now()
        await anyio.sleep(0)
        await anyio.sleep(1e-9)  # under a float's step there
        ais.delay(far)
        await ais.current_stream()
        return slept, ais.virtual.now()

    slept, done = run_in_virtual_time(far_away, backend=backend)
    assert slept == pytest.approx(far, abs=1e-6)
    assert done == pytest.approx(2 * far, abs=1e-5)


async def test_device_time_past_292_years_is_refused_where_it_is_submitted(
    clock: VirtualClock,
) -> None:
    """Work that could take the device past what its clock holds is refused at once, not
    when the clock gets there (which failed the await as the waiter's own failure)."""
    s = ais.Stream()
    ais.delay(5e9, stream=s)
    for submit in (
        lambda: ais.delay(5e9, stream=s),
        lambda: ais.delay(5e9, stream=ais.Stream()),  # counted as if it ran after
    ):
        with pytest.raises(ValueError, match=r"292 years"):
            submit()
    clock.advance(5e9)
    await s
    ais.delay(4e9, stream=s)  # from now on, there is room again
    clock.advance(4e9)
    await s
    assert ais.virtual.now() == 9e9


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_device_time_past_292_years_is_refused_in_virtual_time(backend: str) -> None:
    async def twice() -> None:
        ais.delay(9e9)
        ais.delay(9e9)

    with pytest.raises(ValueError, match=r"292 years"):
        run_in_virtual_time(twice, backend=backend)
