"""CUDA waits: wake latency, CPU, threads and handles of each strategy, at the scale users run,
against the ways people wait today.

Run on a machine with an NVIDIA GPU (``python benchmarks/bench_cuda.py``), or on the stand-in
driver (tests/fake_cuda, which runs kernels on the CPU in real time: its figures say what the
design costs in threads and CPU, not what a GPU's latency is). Every row is measured in this
run, on this device:

0. The short wait: ``await event.synchronize()`` (default strategy) of pending 200 us and 2 ms
   kernels on each loop, against a blocking ``cuEventSynchronize`` of the same work in the
   same thread, interleaved; extra = submission to resumption minus the kernel (goal: median
   ratio at most 1.5 on asyncio and trio, 2 on uvloop). Beside it the await of complete work
   (goal: at most 10 us more than ``cuEventSynchronize`` of complete work) and the
   submission's cost; then driver calls per wait and host functions per 1,000 waits.
1. Short kernels: ``--short`` awaits, one after another, each of a ``--kernel-us`` sleep kernel
   on an idle stream. Latency is the time from submission to the waiting code resuming, minus
   the kernel's duration: what the wait itself adds (launch overhead included, the same for
   all). Baselines: (a) ``cuEventSynchronize`` in a plain thread with no event loop (the
   floor), (b) ``await asyncio.to_thread(torch_event.synchronize)`` (needs torch with a GPU),
   (c) ``await anyio.to_thread.run_sync(cuEventSynchronize)``. Goal: the default strategy's
   (``quiet``) median within 3x of (a).
2. Long waits: the CPU this process uses while one ``--long-s`` wait pends, and while 1,000
   waits on 100 streams pend. Goal: under 1 % of a core for 1,000 pending waits.
3. Waits at scale: 100, 1,000 and 10,000 events on 10, 100 and 1,000 streams awaited at once,
   a third cancelled at random, on asyncio, uvloop and trio: the process's threads and
   aiostream's (peak, and half a second after), what the device holds for aiostream (extra
   streams, events, completion-flag slots; at the peak and after), CPU per wait and wake
   lateness (median, p99), each beside tasks sleeping on the loop's own timer until the same
   moments, the same third giving up (CPU: the whole burst's over the waits begun; goal: at
   most 2x the tasks'). Goal: at most 2 threads of aiostream's per device (it has 1: the
   watcher), nothing held after.
4. How completion is learned: the CPU of one look at n pending waits, by a sweep of the
   completion flags (what the watcher does) and by ``cuEventQuery`` of each (the other way to
   learn without a host function).
5. The host-function-free mode (``quiet``) against ``hybrid``: the CPU of this process while
   1,000 waits on 100 streams pend, and the short wait's ratio (as in 0) for 0.2, 2 and 10 ms
   kernels on each loop.
6. Memory per pending wait, its asyncio task included (tracemalloc): 1,000, 10,000 and
   100,000 waits on events (100 streams) and on streams of their own, on this device and on
   ``virtual:0``. Goal: under 2 KiB. Its CUDA kernels run on a while after it.
7. Two compute streams beside pending waits: 50 kernels of 1 ms on each of two streams, their
   span by the device's clock and their await by the host's, with no waits pending, and
   with 1,000 waits pending on 100 other streams behind 0.5 s of work, with ``hybrid`` (host
   functions enqueued) and ``quiet`` (none), each over the no-waits row
   (``benchmarks/gpu_graphs.py`` step 3 holds every way, with 4 and 32 other streams).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cuda_waits import (
    driver_calls,
    look_cost,
    pending_memory,
    pending_wait,
    print_beside,
    to_thread_wait,
)

import aiostream as ais
from aiostream import _backends
from aiostream._bench.cuda import (
    DEVICE,
    floor_thread,
    pending_cpu,
    scale,
    short_awaits,
    strategy_wait,
)
from aiostream._waiting import STRATEGIES  # the default first

TO_THREAD = "anyio.to_thread.run_sync(cuEventSynchronize)"
LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else []) + ["trio"]


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


def section_0(args: argparse.Namespace) -> None:
    """0. the short wait: pending work against cuEventSynchronize, and driver calls per wait."""
    print("\n0. the short wait: await of pending work vs cuEventSynchronize, same thread, medians")
    print(
        f"   {'kernel':>7} {'loop':8} {'await us':>9} {'sync us':>8} {'ratio':>6} "
        f"{'complete-work await us':>23} {'sync us':>8} {'submit us':>10}"
    )
    n = 50 if args.quick else 300
    for kernel in (200e-6, 2e-3):
        for loop in LOOPS:
            r = pending_wait(loop, kernel, n)
            print(
                f"   {kernel * 1e6:5.0f}us {loop:8} {r['await'] * 1e6:9.1f} "
                f"{r['sync'] * 1e6:8.1f} "
                f"{r['await'] / r['sync']:6.2f} {r['done'] * 1e6:23.1f} "
                f"{r['done_sync'] * 1e6:8.1f} {r['submit'] * 1e6:10.1f}"
            )
    print("   driver calls per wait (submission included) and host functions per 1,000 waits:")
    for streams in (1, 100):
        for kernel in (200e-6, 2e-3):
            per_wait, hosts = driver_calls("asyncio", kernel, 1000, streams)
            print(
                f"   {streams:>3} stream(s), {kernel * 1e6:5.0f} us kernels: "
                f"{per_wait:5.1f} calls per wait, {hosts:6.0f} host functions per 1,000 waits"
            )


def section_1(args: argparse.Namespace) -> None:
    """1. awaits of short kernels, one after another, against the baselines."""
    kernel_s = args.kernel_us * 1e-6
    print(f"\n1. {args.short} awaits of {args.kernel_us:g} us kernels: latency beyond the kernel")
    print(f"   {'method':50} {'median us':>10} {'p99 us':>10} {'CPU s':>8}")
    rows: dict[str, tuple[float, float, float]] = {}

    def row(label: str, lat: list[float], cpu: float) -> None:
        med, p99 = statistics.median(lat) * 1e6, pct(lat, 0.99) * 1e6
        rows[label] = (med, p99, cpu)
        print(f"   {label:50} {med:10.1f} {p99:10.1f} {cpu:8.3f}")

    lat, cpu = floor_thread(args.short, kernel_s)
    row("(a) cuEventSynchronize, plain thread", lat, cpu)
    tw = torch_wait()
    if tw is None:
        print("   (b) asyncio.to_thread(torch_event.synchronize): skipped, torch has no GPU here")
    else:
        lat, cpu = short_awaits(args.short, kernel_s, tw)
        row("(b) await asyncio.to_thread(torch...synchronize)", lat, cpu)
    lat, cpu = short_awaits(args.short, kernel_s, to_thread_wait)
    row("(c) " + TO_THREAD, lat, cpu)
    for strategy in STRATEGIES:
        lat, cpu = short_awaits(args.short, kernel_s, strategy_wait(strategy))
        row(f"aiostream {strategy}", lat, cpu)
    floor = rows["(a) cuEventSynchronize, plain thread"][0]
    default = rows["aiostream quiet"][0]
    print(f"   ratio quiet (the default) / (a) median: {default / floor:.2f} (goal: at most 3)")
    for label in ("(b) await asyncio.to_thread(torch...synchronize)", "(c) " + TO_THREAD):
        if label in rows:
            print(f"   ratio quiet / {label[:3]} median: {default / rows[label][0]:.2f}")


def section_2(args: argparse.Namespace) -> None:
    """2. CPU while waits pend."""
    print(f"\n2. CPU of this process while waits pend ({args.long_s:g} s)")
    waits, streams = (100, 10) if args.quick else (1000, 100)
    for strategy in STRATEGIES:
        wall, share = long_wait_cpu(args.long_s, strategy)
        many = pending_cpu(waits, streams, args.long_s, strategy)
        goal = " (goal: under 1 %)" if strategy in ("hybrid", "callback", "quiet") else ""
        print(
            f"   aiostream {strategy:10} one wait {share * 100:6.2f} % of a core; "
            f"{waits:,} waits on {streams} streams {many * 100:6.2f} %{goal}"
        )


def section_3(args: argparse.Namespace) -> None:
    """3. waits at scale."""
    sizes = [(100, 10)] if args.quick else [(100, 10), (1_000, 100), (10_000, 1_000)]
    print(
        f"\n3. waits at scale ({args.scale_strategy}), a third cancelled at random: threads "
        "beyond those before (process / aiostream's), held = extra streams/events/flag slots"
    )
    print(
        f"   {'waits':>6} {'streams':>7} {'loop':8} {'cancel':>6} {'threads pk/set':>14} "
        f"{'ours pk/set':>11} {'held peak':>11} {'held after':>10} {'CPU/wait us':>16} "
        f"{'late med us':>16} {'late p99 us':>16} {'CPU x':>6}"
    )
    for waits, streams in sizes:
        for loop in LOOPS:
            # CPU per wait is the median of five runs up to 1,000 waits, each side's own (on a
            # shared machine either side's CPU varies up to 2x between runs, independently of
            # the other's: one run's quiet baseline is no measure of the cost); the rest is
            # the first run's
            runs = [scale(waits, streams, loop, args.scale_strategy)]
            if waits <= 1_000 and not args.quick:
                runs += [scale(waits, streams, loop, args.scale_strategy) for _ in range(4)]
            cpu = statistics.median(x.cpu_per_wait_us for x in runs)
            timer_cpu = statistics.median(x.timer_cpu_per_wait_us for x in runs)
            r = runs[0]
            peak, after = (
                "/".join(str(h.get(k, 0)) for k in ("streams", "events", "slots"))
                for h in (r.held_peak, r.held_after)
            )
            print(
                f"   {waits:>6,} {streams:>7,} {loop:8} {r.cancelled:>6} "
                f"{f'{r.threads_peak}/{r.threads_settled}':>14} "
                f"{f'{r.ours_peak}/{r.ours_settled}':>11} {peak:>11} {after:>10} "
                f"{f'{cpu:.1f} ({timer_cpu:.1f})':>16} "
                f"{f'{r.late_median_us:.0f} ({r.timer_late_median_us:.0f})':>16} "
                f"{f'{r.late_p99_us:.0f} ({r.timer_late_p99_us:.0f})':>16} {cpu / timer_cpu:>6.2f}"
            )
    runs = "one run" if args.quick else "each side's median of 5 runs up to 1,000 waits"
    print(
        "   (in brackets: tasks sleeping on the loop's timer until the same moments; CPU: the "
        f"loop's thread and aiostream's, not the driver's, per wait: {runs}, the other columns "
        "the first run's; CPU x: ours over the sleeping tasks', goal at most 2)"
    )


def section_4(args: argparse.Namespace) -> None:
    """4. the cost of one look at n pending waits."""
    print("\n4. how a watching thread learns of completions: CPU of one look at n pending waits")
    print(f"   {'n':>7} {'sweep of the flags us':>22} {'cuEventQuery each us':>21} {'ratio':>7}")
    for n in (100, 1_000) if args.quick else (100, 1_000, 10_000):
        flags, queries = look_cost(n)
        print(f"   {n:>7,} {flags * 1e6:22.1f} {queries * 1e6:21.1f} {queries / flags:7.1f}")


def section_5(args: argparse.Namespace) -> None:
    """5. no host functions (quiet) against hybrid."""
    print("\n5. no host functions (quiet) against hybrid")
    pend, over = (100, 10) if args.quick else (1000, 100)
    for strategy in ("hybrid", "quiet"):
        share = pending_cpu(pend, over, args.long_s, strategy)
        print(f"   {strategy:7} CPU while {pend:,} waits pend: {share * 100:5.2f} % of a core")
    print(f"   {'kernel':>7} {'loop':8} {'hybrid':>8} {'quiet':>8}   (await / cuEventSynchronize)")
    for kernel in (200e-6, 2e-3, 10e-3):
        for loop in LOOPS:
            ratios = []
            for strategy in ("hybrid", "quiet"):
                r = pending_wait(loop, kernel, 50 if args.quick else 150, strategy)
                ratios.append(r["await"] / r["sync"])
            print(f"   {kernel * 1e3:5.1f}ms {loop:8} {ratios[0]:8.2f} {ratios[1]:8.2f}")


def section_6(args: argparse.Namespace) -> None:
    """6. memory per pending wait."""
    print("\n6. memory per pending wait, its task included (goal: under 2 KiB)")
    print(f"   {'waits':>7} {'on':8} {DEVICE:>10} {'virtual:0':>10}")
    for n in (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000):
        for on in ("events", "streams") if n <= 10_000 else ("events",):
            ours, sim = pending_memory(DEVICE, n, on), pending_memory("virtual:0", n, on)
            print(f"   {n:>7,} {on:8} {ours:8.0f} B {sim:8.0f} B")


def section_7(args: argparse.Namespace) -> None:
    """7. two compute streams beside pending waits."""
    others, pend, kernels = (10, 100, 10) if args.quick else (100, 1_000, 50)
    print(
        f"\n7. two streams x {kernels} kernels of 1 ms beside {pend:,} waits pending on "
        f"{others} other streams (x: over no waits)"
    )
    hows = ("none", "hybrid", "quiet")
    print_beside((others,), hows, waits=pend, kernels=kernels, pending_s=0.2 if args.quick else 0.5)


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "0": section_0,
    "1": section_1,
    "2": section_2,
    "3": section_3,
    "4": section_4,
    "5": section_5,
    "6": section_6,
    "7": section_7,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=1000, help="awaits of short kernels")
    parser.add_argument("--kernel-us", type=float, default=20.0, help="short kernel length")
    parser.add_argument("--long-s", type=float, default=1.0, help="long wait length")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument(
        "--sections", default="01234567", help="which sections run, e.g. 0 or 1234567"
    )
    parser.add_argument(
        "--scale-strategy", default="quiet", choices=STRATEGIES, help="section 3's strategy"
    )
    args = parser.parse_args()
    if not args.sections or not set(args.sections) <= SECTIONS.keys():
        parser.error(f"--sections takes digits 0 to 7, not {args.sections!r}")
    if args.quick:
        args.short, args.long_s = 50, 0.1
    ok, reason = _backends.probe("cuda")
    if not ok:
        print(f"bench_cuda: skipped, no CUDA device here: {reason}")
        return
    name = _backends.get("cuda").device_name(0)  # type: ignore[attr-defined]
    print(
        f"CUDA wait benchmark, {datetime.date.today()}, {name} ({DEVICE}), "
        f"Python {platform.python_version()}"
    )
    for key in sorted(set(args.sections)):
        SECTIONS[key](args)


if __name__ == "__main__":
    main()
