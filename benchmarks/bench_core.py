"""Core runtime figures on the virtual backend, each against a baseline measured in the same run.

1. Awaiting an already complete event, as a ratio to ``await anyio.lowlevel.checkpoint()``
   (goal: at most 1.5).
2. Wake lateness (resume time minus device completion time) of 1,000 concurrent waits whose
   work completes 1 ms apart, median and p99, as a ratio to a bare loop timer set for the same
   moments: ``loop.call_at`` on asyncio and uvloop, ``trio.sleep_until`` in a task on trio,
   which has no timer callbacks (goal: median ratio at most 2). uvloop's timers fire up to a
   millisecond early, which makes their lateness negative; so the script also measures timers
   re-armed until their moment has passed, the floor for a waker that must not fire early.
3. CPU seconds burnt while 1,000 waits are pending for one second, against the hand-written
   loop ``while not e.query(): await anyio.sleep(0)`` (goal: under 5 % of it).

Usage: python benchmarks/bench_core.py [--loops asyncio,uvloop,trio] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.lowlevel

import aiostream as ais

DEVICE = "virtual:0"  # the waiter's own costs, on the simulated device (bench_cuda.py: GPUs)


def run_on(loop: str, fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    # Each phase starts from a collected heap, so that no phase pays for an earlier one's
    # garbage (a full collection during a phase costs tens of milliseconds).
    gc.collect()
    if loop == "trio":
        return anyio.run(fn, backend="trio")
    return anyio.run(fn, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


# ---------------------------------------------------------------------- 1. fast path


async def fast_path(n: int, rounds: int) -> tuple[float, float]:
    """Median seconds per await: (complete event, bare checkpoint)."""
    ais.virtual.reset()
    e = ais.Stream(DEVICE).record_event()
    assert e.query()
    checkpoint = anyio.lowlevel.checkpoint
    ours, base = [], []
    for _ in range(rounds):  # interleaved, so drift and noise hit both alike
        t = time.perf_counter()
        for _ in range(n):
            await checkpoint()
        base.append((time.perf_counter() - t) / n)
        t = time.perf_counter()
        for _ in range(n):
            await e.synchronize()
        ours.append((time.perf_counter() - t) / n)
    return statistics.median(ours), statistics.median(base)


# ---------------------------------------------------------------------- 2. wake lateness


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def lateness_ours(n: int, gap: float, streams: int) -> list[float]:
    ais.virtual.reset()  # the monotonic clock: device work takes real time
    lanes = [ais.Stream(DEVICE) for _ in range(streams)]
    events = []
    lead = 0.05  # time to start every task before the first completion
    ais.delay(lead, stream=lanes[0])
    for i in range(n):
        s = lanes[i % streams]
        ais.delay(gap, stream=s)  # one compute slot: completions come `gap` apart
        events.append(s.record_event())
    late: list[float] = []

    async def waiter(e: ais.Event) -> None:
        await e.synchronize()
        late.append(time.monotonic())

    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(waiter, e)
    ends = sorted(r.end for r in ais.virtual.timeline() if r.name == "delay")[1:]
    assert len(ends) == n and len(late) == n
    # waits on distinct moments resume in completion order
    return [resumed - end for resumed, end in zip(sorted(late), ends, strict=True)]


async def lateness_base(n: int, gap: float, loop: str, rearm: bool = False) -> list[float]:
    """Lateness of bare loop timers at the same moments. With ``rearm``, a timer that fires
    early (libuv's do, by up to a millisecond) is set again until the moment has passed: the
    floor for a waker that must not resume anything before its work is done."""
    start = time.monotonic() + 0.05
    moments = [start + gap * (i + 1) for i in range(n)]
    late: list[float] = []
    if loop == "trio":
        import trio

        offset = trio.current_time() - time.monotonic()

        async def sleeper(when: float) -> None:
            await trio.sleep_until(when + offset)
            late.append(time.monotonic() - when)

        async with trio.open_nursery() as nursery:
            for when in moments:
                nursery.start_soon(sleeper, when)
        return late
    import asyncio

    aloop = asyncio.get_running_loop()
    offset = aloop.time() - time.monotonic()
    done = asyncio.Event()

    def fire(when: float) -> None:
        now = time.monotonic()
        if rearm and now < when:
            aloop.call_later(when - now, fire, when)
            return
        late.append(now - when)
        if len(late) == n:
            done.set()

    for when in moments:
        aloop.call_at(when + offset, fire, when)
    await done.wait()
    return late


# ---------------------------------------------------------------------- 3. CPU while pending


async def cpu_pending(n: int, seconds: float, busy: bool) -> tuple[float, float]:
    """CPU seconds of this process while n tasks wait `seconds` for device work: in the steady
    window from 10 % to 90 % of the wait, and over the whole run (start-up and wake-up too)."""
    ais.virtual.reset()
    s = ais.Stream(DEVICE)
    ais.delay(seconds, stream=s)
    events = [s.record_event() for _ in range(n)]

    async def hand_loop(e: ais.Event) -> None:
        while not e.query():
            await anyio.sleep(0)

    async def awaiting(e: ais.Event) -> None:
        await e.synchronize()

    t = time.process_time()
    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(hand_loop if busy else awaiting, e)
        await anyio.sleep(seconds * 0.1)
        c0 = time.process_time()
        await anyio.sleep(seconds * 0.8)
        steady = time.process_time() - c0
    return steady, time.process_time() - t


# ---------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", default="asyncio,uvloop,trio")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args()
    loops = [name for name in args.loops.split(",") if name]
    quick = args.quick
    n_fast, rounds = (2_000, 3) if quick else (50_000, 7)
    n_wait, gap = (100, 0.001) if quick else (1_000, 0.001)
    n_cpu, pending = (100, 0.1) if quick else (1_000, 1.0)

    print(
        f"aiostream {ais.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {platform.system()} {platform.release()}"
    )
    print(f"virtual backend, monotonic clock{' (quick run: small sizes)' if quick else ''}\n")
    rows = []
    for loop in loops:
        ours, base = run_on(loop, lambda: fast_path(n_fast, rounds))
        ours_late = run_on(loop, lambda: lateness_ours(n_wait, gap, 8))
        base_late = run_on(loop, lambda loop=loop: lateness_base(n_wait, gap, loop))
        floor_late = run_on(loop, lambda loop=loop: lateness_base(n_wait, gap, loop, rearm=True))
        cpu_ours = run_on(loop, lambda: cpu_pending(n_cpu, pending, busy=False))
        cpu_base = run_on(loop, lambda: cpu_pending(n_cpu, pending, busy=True))
        med_o, med_b = statistics.median(ours_late), statistics.median(base_late)
        p99_o, p99_b = percentile(ours_late, 0.99), percentile(base_late, 0.99)
        med_f, p99_f = statistics.median(floor_late), percentile(floor_late, 0.99)
        rows.append(
            (loop, ours, base, med_o, med_b, p99_o, p99_b, med_f, p99_f, cpu_ours, cpu_base)
        )

    print("1. await on a complete event vs await anyio.lowlevel.checkpoint()  (goal: <= 1.5)")
    for loop, ours, base, *_ in rows:
        print(
            f"   {loop:8} {ours * 1e6:7.2f} us vs {base * 1e6:7.2f} us   ratio {ours / base:5.2f}"
        )
    print(
        f"\n2. wake lateness of {n_wait} concurrent waits, completions {gap * 1e3:g} ms apart, "
        "vs a bare loop timer  (goal: median ratio <= 2)"
    )
    print(
        "   a: bare call_at (trio: sleep_until);  b: a timer re-armed until its moment has passed"
    )
    for loop, _, _, med_o, med_b, p99_o, p99_b, med_f, p99_f, *_ in rows:
        print(
            f"   {loop:8} median ours {med_o * 1e6:6.1f} us, a {med_b * 1e6:7.1f} us "
            f"(ratio {med_o / med_b:5.2f}), b {med_f * 1e6:6.1f} us (ratio {med_o / med_f:5.2f});"
            f"  p99 ours {p99_o * 1e6:6.1f} us, a {p99_b * 1e6:6.1f}, b {p99_f * 1e6:6.1f}"
        )
    print(
        f"\n3. CPU while {n_cpu} waits are pending for {pending:g} s vs the hand-written "
        "query loop  (goal: < 5 %)"
    )
    print("   steady window (10 % to 90 % of the wait) | whole run, with start-up and wake-up")
    for loop, *_, (ours_w, ours_all), (base_w, base_all) in rows:
        print(
            f"   {loop:8} {ours_w * 1e3:7.2f} ms vs {base_w * 1e3:7.1f} ms CPU  "
            f"{100 * ours_w / base_w:5.2f} %  |  {ours_all * 1e3:6.1f} ms vs "
            f"{base_all * 1e3:7.1f} ms  {100 * ours_all / base_all:5.2f} %"
        )


if __name__ == "__main__":
    main()
