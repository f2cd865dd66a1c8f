"""CUDA waits: wake latency and CPU of each strategy, against the ways people wait today.

Run on a machine with an NVIDIA GPU (``python benchmarks/bench_cuda.py``). Every row is
measured in this run, on this device:

1. Short kernels: ``--short`` awaits, one after another, each of a ``--kernel-us`` sleep kernel
   on an idle stream. Latency is the time from submission to the waiting code resuming, minus the
   kernel's duration: what the wait itself adds (launch overhead included, the same for all).
2. Long waits: a ``--long-s`` kernel, awaited once per strategy; the CPU this process used
   meanwhile, as a share of one core.
3. Concurrent awaits: 100 tasks on 100 streams, each awaiting 10 short kernels in turn (1,000
   awaits), per strategy: latency beyond the kernel, CPU and wall time.

Baselines: (a) ``cuEventSynchronize`` in a plain thread with no event loop (the floor), and (b)
``await asyncio.to_thread(torch_event.synchronize)`` (what users write today; needs torch).
Goals: hybrid's median latency within 2x of (a) and below (b); under 5 % of a core while a
long wait is pending in ``thread`` and ``hybrid``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiostream as ais
from aiostream import _backends
from aiostream._bench.cuda import DEVICE, floor_thread, short_awaits, strategy_wait

STRATEGIES = ("hybrid", "poll", "thread", "callback")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def torch_wait() -> Callable[[ais.Stream, ais.Event], Awaitable[None]] | None:
    """(b): await asyncio.to_thread(torch_event.synchronize), on the same stream."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    events: dict[int, Any] = {}

    async def wait(s: ais.Stream, e: ais.Event) -> None:
        ext = torch.cuda.ExternalStream(s.stream_id)
        te = events.get(s.stream_id)
        if te is None:
            te = events[s.stream_id] = torch.cuda.Event()
        te.record(ext)
        await asyncio.to_thread(te.synchronize)

    return wait


def long_wait_cpu(seconds: float, strategy: str) -> tuple[float, float]:
    """(wall s, CPU share of one core) while one wait of ``seconds`` is pending."""

    async def main() -> tuple[float, float]:
        s = ais.Stream(DEVICE)
        ais.delay(0.001, stream=s)
        await s.synchronize(strategy=strategy)  # warm-up
        ais.delay(seconds, stream=s)
        e = s.record_event()
        cpu, wall = time.process_time(), time.perf_counter()
        await e.synchronize(strategy=strategy)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        return wall, cpu / wall

    return asyncio.run(main())


def concurrent_awaits(
    streams: int, per_stream: int, kernel_s: float, strategy: str
) -> tuple[list[float], float, float]:
    """``streams`` tasks, each on its own stream, each awaiting ``per_stream`` short kernels
    one after another, all at once: latencies beyond the kernel, CPU s, wall s."""

    async def main() -> tuple[list[float], float, float]:
        pairs = [(ais.Stream(DEVICE), ais.Event(DEVICE)) for _ in range(streams)]
        for s, e in pairs:  # warm-up
            ais.delay(kernel_s, stream=s)
            e.record(s)
            await e.synchronize(strategy=strategy)
        out: list[float] = []

        async def task(s: ais.Stream, e: ais.Event) -> None:
            for _ in range(per_stream):
                t0 = time.perf_counter()
                ais.delay(kernel_s, stream=s)
                e.record(s)
                await e.synchronize(strategy=strategy)
                out.append(time.perf_counter() - t0 - kernel_s)

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(task(s, e) for s, e in pairs))
        return out, time.process_time() - cpu, time.perf_counter() - wall

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=1000, help="awaits of short kernels")
    parser.add_argument("--kernel-us", type=float, default=20.0, help="short kernel length")
    parser.add_argument("--long-s", type=float, default=1.0, help="long wait length")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.short, args.long_s = 50, 0.1
    ok, reason = _backends.probe("cuda")
    if not ok:
        print(f"bench_cuda: skipped, no CUDA device here: {reason}")
        return
    name = _backends.get("cuda").device_name(0)  # type: ignore[attr-defined]
    kernel_s = args.kernel_us * 1e-6
    print(
        f"CUDA wait benchmark, {datetime.date.today()}, {name} ({DEVICE}), "
        f"Python {platform.python_version()}"
    )
    print(f"\n1. {args.short} awaits of {args.kernel_us:g} us kernels: latency beyond the kernel")
    print(f"   {'method':44} {'median us':>10} {'p99 us':>10} {'CPU s':>8}")
    rows: dict[str, tuple[float, float, float]] = {}

    def row(label: str, lat: list[float], cpu: float) -> None:
        med, p99 = statistics.median(lat) * 1e6, pct(lat, 0.99) * 1e6
        rows[label] = (med, p99, cpu)
        print(f"   {label:44} {med:10.1f} {p99:10.1f} {cpu:8.3f}")

    lat, cpu = floor_thread(args.short, kernel_s)
    row("(a) cuEventSynchronize, plain thread", lat, cpu)
    tw = torch_wait()
    if tw is None:
        print("   (b) asyncio.to_thread(torch_event.synchronize): skipped, torch has no GPU here")
    else:
        lat, cpu = short_awaits(args.short, kernel_s, tw)
        row("(b) await asyncio.to_thread(torch...synchronize)", lat, cpu)
    for strategy in STRATEGIES:
        lat, cpu = short_awaits(args.short, kernel_s, strategy_wait(strategy))
        row(f"aiostream {strategy}", lat, cpu)
    floor = rows["(a) cuEventSynchronize, plain thread"][0]
    hybrid = rows["aiostream hybrid"][0]
    print(f"   ratio hybrid / (a) median: {hybrid / floor:.2f} (goal: at most 2)")
    if "(b) await asyncio.to_thread(torch...synchronize)" in rows:
        b = rows["(b) await asyncio.to_thread(torch...synchronize)"][0]
        print(f"   ratio hybrid / (b) median: {hybrid / b:.2f} (goal: below 1)")

    print(f"\n2. one {args.long_s:g} s wait: CPU of this process while it is pending")
    for strategy in STRATEGIES:
        wall, share = long_wait_cpu(args.long_s, strategy)
        goal = " (goal: under 5 %)" if strategy in ("thread", "hybrid") else ""
        print(f"   aiostream {strategy:10} {share * 100:6.2f} % of a core over {wall:.3f} s{goal}")

    streams, per_stream = (10, 5) if args.quick else (100, 10)
    print(
        f"\n3. {streams * per_stream} concurrent awaits: {streams} tasks on {streams} streams, "
        f"{per_stream} {args.kernel_us:g} us kernels each, awaited one after another"
    )
    print(f"   {'method':44} {'median us':>10} {'p99 us':>10} {'CPU s':>8} {'wall s':>8}")
    for strategy in STRATEGIES:
        lat, cpu, wall = concurrent_awaits(streams, per_stream, kernel_s, strategy)
        print(
            f"   {'aiostream ' + strategy:44} {statistics.median(lat) * 1e6:10.1f} "
            f"{pct(lat, 0.99) * 1e6:10.1f} {cpu:8.3f} {wall:8.3f}"
        )


if __name__ == "__main__":
    main()
