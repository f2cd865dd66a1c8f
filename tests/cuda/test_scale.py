"""CUDA waits at scale: one thread per device whatever the load, flag memory that grows with
the pending waits and shrinks when idle, waits on hung kernels that time out leaving nothing,
pending waits that say where they wait, and polled waits that no other stream holds back.

Run where ``cuda:0`` works: on a GPU, and in CI's CUDA lane against the stand-in driver. Work
that must not end while a test runs (a "hung kernel") is held by a gate
(``tests/helpers/gate.py``) until the test lets it go, on any driver.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.cuda import DEV, held
from tests.helpers.deadlines import deadline, until
from tests.helpers.gate import gate, gated
from tests.helpers.protocol import STRATEGIES

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


# ------------------------------------------------------ counting threads


def ours() -> list[str]:
    """aiostream's threads now alive for cuda:0 (another device's watcher may live on from an
    earlier test), and any of aiostream's that names no device."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("aiostream") and ("cuda:" not in t.name or DEV in t.name)
    ]


class ThreadPeak:
    """The most aiostream threads and Python threads alive at once, sampled every 2 ms."""

    def __init__(self) -> None:
        self.ours = 0
        self.python = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="test sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.ours = max(self.ours, len(ours()))
            self.python = max(self.python, threading.active_count())

    def __enter__(self) -> ThreadPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def settle(before_slots: int) -> dict[str, int]:
    """Wait (up to 2 s) for the watcher to free the slots of cancelled waits."""
    with anyio.fail_after(2):
        while (now := held())["slots"] > before_slots:
            await anyio.sleep(0.01)
    return now


# ----------------------------------------------------------------- scale


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_a_thousand_waits_on_a_hundred_streams_use_one_thread(
    anyio_backend: object, strategy: str
) -> None:
    """1,000 events on 100 streams awaited at once, a third cancelled at random: at most one
    thread of aiostream's (the device's watcher) however many waits, and nothing held after."""
    before = held()
    base_python = threading.active_count()
    rng = random.Random(21)
    streams = [ais.Stream(DEV) for _ in range(100)]
    events = []
    releases = []
    for i, s in enumerate(streams):
        # nothing completes before the waits have begun and the cancelled ones have given up,
        # however loaded the machine (the gates let the work go when the test says)
        releases.append(gate(s))
        for k in range(10):
            ais.delay(0.01 + 0.002 * ((i + k) % 7), stream=s)  # 0.1 to 0.2 s a stream
            events.append(s.record_event())
    cancel = [rng.uniform(0, 0.1) if rng.random() < 1 / 3 else None for _ in events]
    outcomes = {"done": 0, "cancelled": 0}

    async def wait(e: ais.Event, after: float | None) -> None:
        if after is not None:
            with anyio.move_on_after(after) as scope:
                await e.synchronize(strategy=strategy)
            if scope.cancelled_caught:
                outcomes["cancelled"] += 1
                return
        else:
            await e.synchronize(strategy=strategy)
        assert e.query()
        outcomes["done"] += 1

    cancelled = sum(after is not None for after in cancel)
    try:
        with ThreadPeak() as peak:
            with deadline(60, "every wait to end, or to be cancelled"):
                async with anyio.create_task_group() as tg:
                    for e, after in zip(events, cancel, strict=True):
                        tg.start_soon(wait, e, after)
                    while outcomes["cancelled"] < cancelled:
                        await anyio.sleep(0.001)
                    for release in releases:  # the work goes now
                        release()
    finally:
        for release in releases:
            release()
    assert outcomes == {"done": 1000 - cancelled, "cancelled": cancelled} and cancelled > 300
    assert peak.ours <= 1, peak.ours  # the watcher of cuda:0, whatever the number of waits
    assert peak.python - base_python <= 2, (peak.python, base_python)  # it, and the sampler
    assert ais.pending_waits() == []
    after = await settle(before["slots"])
    assert after["watched"] == 0
    # no stream or event per wait (the health event may be new)
    assert after["streams"] <= 1 and after["events"] <= before["events"] + 1, after
    assert len(ours()) <= 1


async def test_flag_memory_grows_with_pending_waits_and_shrinks_when_idle(
    anyio_backend: object,
) -> None:
    before = held()
    s = ais.Stream(DEV)
    # nothing completes before every wait has begun, however loaded the machine (the gate lets
    # the work go when the test says)
    release = gate(s)
    ais.delay(0.001, stream=s)
    pending = [s.record_event() for _ in range(5000)]  # more waits than a chunk has slots
    ended = 0

    async def wait(e: ais.Event) -> None:
        nonlocal ended
        await e.synchronize(strategy="thread")
        ended += 1

    captured = 0
    try:
        with deadline(60, "every wait to begin, then to end"):
            async with anyio.create_task_group() as tg:
                for e in pending:
                    tg.start_soon(wait, e)
                await until(
                    lambda: len(ais.pending_waits()) == 5000, "every wait to begin", seconds=60
                )
                captured = held()["chunks"]
                release()  # the work goes now
    finally:
        release()
    assert captured >= 2
    after = await settle(before["slots"])
    await until(lambda: held()["chunks"] <= 1, "the flag memory to shrink to one chunk", seconds=2)
    assert after["watched"] == 0


# ---------------------------------------------------------- hung kernels


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_a_wait_on_a_hung_kernel_times_out_and_leaves_nothing(
    anyio_backend: object, strategy: str
) -> None:
    before = held()
    s = ais.Stream(DEV)
    with gated(s):  # work that does not end while the test looks
        ais.delay(0.001, stream=s)
        e = s.record_event()
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.2):
                await e.synchronize(strategy=strategy)
        late = time.monotonic() - start - 0.2
        assert late < 0.05, f"TimeoutError {late * 1e3:.1f} ms after its deadline"
        assert ais.pending_waits() == []
        now = held()
        assert now["watched"] == 0  # no wait left; its slot drains when the work ends
        assert now["slots"] <= before["slots"] + 1
        assert now["streams"] <= 1 and now["events"] <= before["events"] + 1
        assert len(ours()) <= 1  # no thread blocked on the work


async def test_pending_waits_name_the_stream_task_origin_and_age(anyio_backend: object) -> None:
    ais.set_debug(True)
    s = ais.Stream(DEV)
    with gated(s):  # the work does not end while the test looks
        ais.delay(0.001, stream=s)
        e = s.record_event()  # recorded here
        seen: list[Any] = []

        async def stuck() -> None:
            await e.synchronize()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stuck, name="stuck task")
            await anyio.sleep(0.1)
            seen = ais.pending_waits()
            tg.cancel_scope.cancel()
    assert len(seen) == 1
    wait = seen[0]
    assert wait.task == "stuck task" and wait.device == DEV
    assert wait.subject == f"event {e.event_id} on stream {s.stream_id}"
    assert wait.waited >= 0.09
    assert wait.recorded_at is not None and Path(__file__).name in wait.recorded_at
    assert f"waited {wait.waited:.3f} s on event" in str(wait)
    assert ais.pending_waits() == []


async def test_a_polled_wait_is_not_held_behind_another_streams(anyio_backend: object) -> None:
    """Polled waits are looked at per stream, the oldest of each first: a wait on a stream
    whose work is done ends while a wait begun before it, on another stream, still waits for
    work that does not end."""
    slow, quick = ais.Stream(DEV), ais.Stream(DEV)
    with gated(slow):  # work that does not end while the test looks
        ais.delay(0.001, stream=slow)
        ais.delay(0.005, stream=quick)
        for _ in range(3):  # the quick stream's capture comes later in its order than the slow's
            quick.record_event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: slow.synchronize(strategy="poll"))
            await until(ais.pending_waits, "the wait on the slow stream to begin")
            with deadline(5, "the quick stream's wait to end while the slow one's waits on"):
                await quick.synchronize(strategy="poll")
            assert not slow.query()
            tg.cancel_scope.cancel()
