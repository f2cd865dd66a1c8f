"""A storm: thousands of waits on hundreds of streams, with random timeouts, faults, stalls,
raising host functions, blocking waits in threads and resets, on every loop.

Whatever happens to it, every wait ends (it returns, times out, or raises a documented
error) and nothing is left pending: no wait on any backend, retired ones included (no wait
capture of their work still held), and no operation on the last one once its stalls are
released.
"""

from __future__ import annotations

import random

import anyio
import anyio.to_thread
import pytest

import aiostream as ais
from tests.helpers.virtual import Spy, spy_on_waits

pytestmark = pytest.mark.anyio

EVERY_LOOP = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]
WAITS = 3000
STREAMS = 200
#: what a wait may end with besides returning: the device failed (a fault, a raising host
#: function), or a reset replaced the backend under it
ENDINGS = (ais.DeviceError, ais.StaleHandleError)


class Storm:
    """The shared state: the current streams, a spy on every backend seen (what its waits
    captured and let go), counts of how waits ended."""

    def __init__(self, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rng = random.Random(seed)
        self.monkeypatch = monkeypatch
        self.backends: list[Spy] = []
        self.streams: list[ais.Stream] = []
        self.ended = {"returned": 0, "timed out": 0, "device error": 0, "stale": 0}
        self.renew()

    def renew(self) -> None:
        ais.virtual.reset(compute_slots=8, h2d_slots=2, d2h_slots=2)
        self.backends.append(spy_on_waits(self.monkeypatch))
        self.streams = [ais.Stream(priority=-(i % 2)) for i in range(STREAMS)]

    def count(self, outcome: str) -> None:
        self.ended[outcome] += 1


async def _one_wait(storm: Storm, i: int) -> None:
    rng = storm.rng
    timeout = rng.choice([None, None, 0.0, 1e-4, 1e-3, 5e-3])
    try:
        s = rng.choice(storm.streams)
        for _ in range(rng.randint(1, 3)):
            ais.delay(rng.uniform(0.0, 200e-6), stream=s)
        roll = rng.random()
        if roll < 0.003:  # a host function that raises fails the device
            ais.virtual.submit(s, 50e-6, fn=_raise, name=f"raising {i}")
        elif roll < 0.03:
            ais.virtual.submit(s, 50e-6, engine="h2d", fn=lambda: None, name=f"copy {i}")
        other = rng.choice(storm.streams)
        if roll > 0.9:
            other.wait_stream(s)
        with anyio.move_on_after(timeout):  # None: no timeout
            if roll < 0.5:
                await s.synchronize()
            elif roll < 0.7:
                await s.record_event().synchronize()
            elif roll < 0.8:
                await anyio.to_thread.run_sync(s.synchronize_blocking)
            else:
                await other.synchronize()
            storm.count("returned")
            return
        storm.count("timed out")
    except ais.DeviceError:
        storm.count("device error")
    except ais.StaleHandleError:
        storm.count("stale")


def _raise() -> None:
    raise ZeroDivisionError("a host function failed")


async def _chaos(storm: Storm, stop: anyio.Event) -> None:
    """Faults, stalls and resets, at random moments, until the waits are all done."""
    rng = storm.rng
    while not stop.is_set():
        await anyio.sleep(rng.uniform(0.0, 20e-3))
        roll = rng.random()
        try:
            if roll < 0.05:
                ais.virtual.fail_next(engine=rng.choice(["compute", "h2d"]), message="storm")
            elif roll < 0.3:
                ais.virtual.slow_next(rng.uniform(1.0, 10.0), n=rng.randint(1, 20))
            elif roll < 0.6:
                with ais.virtual.stall(rng.choice(["compute", "h2d", "d2h"])):
                    await anyio.sleep(rng.uniform(0.0, 5e-3))
            elif roll < 0.8:
                storm.renew()
        except ENDINGS:  # a stall released after a reset replaced its backend
            pass


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", EVERY_LOOP)
async def test_a_storm_of_waits_ends_every_wait_and_leaves_nothing_pending(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    storm = Storm(seed=20261123, monkeypatch=monkeypatch)
    stop = anyio.Event()
    with anyio.fail_after(50):
        async with anyio.create_task_group() as chaos:
            chaos.start_soon(_chaos, storm, stop)
            async with anyio.create_task_group() as waits:
                for i in range(WAITS):
                    waits.start_soon(_one_wait, storm, i)
                    if i % 50 == 49:  # in waves, as requests come: about 2 s in all
                        await anyio.sleep(storm.rng.uniform(0.0, 60e-3))
            stop.set()
    assert sum(storm.ended.values()) == WAITS, storm.ended
    # waits returned, timed out and failed; how many of each depends on where the faults and
    # resets fell, which the machine's load moves (returned: from 695 of 3,000 seen here)
    assert storm.ended["returned"] and storm.ended["timed out"], storm.ended
    assert storm.ended["device error"], storm.ended
    assert len(storm.backends) > 1, "the storm never reset the backend"
    for spy in storm.backends:  # no wait left on any backend: every capture was let go
        assert spy.outstanding == 0, (spy.backend, spy.outstanding, storm.ended)
    # the last backend: once its work drains (or its device failed), nothing is pending
    with anyio.fail_after(10):
        for s in storm.streams:
            try:
                await s.synchronize()
            except ais.DeviceError:
                break
    stats = ais.virtual.stats()
    assert (stats.waits, stats.operations) == (0, 0), stats
