"""The host-function-free strategy, ``quiet``: for devices where a host function may hold up
other streams' kernels. Its waits end with their work, on every loop, short or long, on
streams and events, with nothing added to the user's streams but the completion flag's
write; it is chosen per call, globally, or by ``AIOSTREAM_WAIT_STRATEGY``."""

from __future__ import annotations

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, program
from tests.helpers.stand_in import FAKE

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


async def test_quiet_waits_end_with_their_work_and_launch_no_host_function(
    anyio_backend: object,
) -> None:
    s, other = ais.Stream(DEV), ais.Stream(DEV)
    calls = FAKE.fake_cuda_host_calls() if FAKE is not None else 0
    with anyio.fail_after(30):
        for seconds in (0.0, 0.0002, 0.002, 0.002, 0.002, 0.002, 0.01):
            ais.delay(seconds, stream=s)
            e = s.record_event()
            ais.delay(seconds, stream=other)
            await e.synchronize(strategy="quiet")
            assert e.query()
            await other.synchronize(strategy="quiet")
            assert other.query()
        events = []
        for _ in range(50):  # records back to back, awaited at once
            ais.delay(0.001, stream=s)
            events.append(s.record_event())
        async with anyio.create_task_group() as tg:
            for e in events:
                tg.start_soon(lambda e=e: e.synchronize(strategy="quiet"))
    assert all(e.query() for e in events)
    if FAKE is not None:  # the host functions the driver ran: the stand-in counts them
        assert FAKE.fake_cuda_host_calls() == calls


async def test_quiet_is_chosen_globally(anyio_backend: object) -> None:
    ais.set_wait_strategy("quiet")
    try:
        assert ais.get_wait_strategy() == "quiet"
        s = ais.Stream(DEV)
        ais.delay(0.003, stream=s)
        with anyio.fail_after(30):
            await s.record_event().synchronize()
        assert s.query()
    finally:
        ais.set_wait_strategy(None)


def test_quiet_is_chosen_by_the_environment() -> None:
    """``AIOSTREAM_WAIT_STRATEGY=quiet``: waits end, and (counted where the stand-in counts
    the host functions its driver ran) none was launched."""
    result = program(
        """
        import anyio, aiostream as ais
        from tests.helpers.stand_in import FAKE

        def host_calls():
            return FAKE.fake_cuda_host_calls() if FAKE is not None else 0

        async def main():
            s = ais.Stream("cuda:0")
            before = host_calls()
            for _ in range(5):
                ais.delay(0.002, stream=s)
                with anyio.fail_after(30):
                    await s.record_event().synchronize()
            print(ais.get_wait_strategy(), s.query(), host_calls() - before)

        anyio.run(main)
        """,
        AIOSTREAM_WAIT_STRATEGY="quiet",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["quiet", "True", "0"]
