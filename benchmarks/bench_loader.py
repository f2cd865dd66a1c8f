"""The data loader's overlap, in real time and in virtual time, against its ideal and a
sequential run; and how ``workers`` scales a CPU-heavy transform.

1. Real time (wall clock), ``virtual:0`` on the monotonic clock, on asyncio, uvloop and trio:
   the demo's default pipeline (``python -m aiostream demo``: a 2 ms host transform, 1 MiB
   copies, 3 ms compute) against ``batches x max(stage)``, the stages as the sequential run
   measured them (goal: at least 0.90), and against the sequential run itself (goal: at least
   1.8x). Each figure is the median of ``--repeats`` runs. Then the same with one worker, and
   with batches of growing size (asyncio), to show how the cost grows.
2. Real time: a CPU-bound numpy transform (which releases the GIL) with ``workers`` = 1, 2 and
   4 (threads), on a device that is never the bottleneck (goal on a 2-core machine: workers=2
   at least 1.7x workers=1), beside the same transform in plain threads (what the cores allow).
3. Virtual time (exact: host work and the loop's own costs take no time there): four pipelines
   of chosen stage durations against 1 / max(stage) (goal: at least 0.95).

Peak buffers in use: at most prefetch + 2 everywhere.

Usage: python benchmarks/bench_loader.py [--batches 100] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import numpy as np

import aiostream as ais
from aiostream._bench import demo
from aiostream._bench.loader import real_time_pipeline
from aiostream.testing import run_in_virtual_time

T = TypeVar("T")
LOOPS = ("asyncio", "uvloop", "trio")
LATENCY = 10e-6
SCENARIOS = {  # (host, copy, compute) in ms
    "compute-bound": (2.0, 1.0, 3.0),
    "host-bound": (4.0, 1.0, 2.0),
    "copy-bound": (1.0, 3.0, 2.0),
    "balanced": (2.0, 2.0, 2.0),
}


def run_on(loop: str, fn: Callable[[], Awaitable[T]]) -> T:
    if loop == "trio":
        return anyio.run(fn, backend="trio")
    return anyio.run(fn, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


# ---------------------------------------------------------------------------- 1. real time


def section_real_time(batches: int, repeats: int, loops: list[str]) -> None:
    device = ais.Device("virtual", 0)
    print(
        "1. Real time (wall clock), virtual:0 on the monotonic clock; the demo's pipeline: "
        f"{batches} batches, host 2 ms, compute 3 ms; median of {repeats} runs"
    )
    print(
        f"   {'loop':8} {'batch':>8} {'workers':>7} {'bottleneck':>14} "
        f"{'pipelined/ideal':>16} {'x sequential':>13} {'peak buffers':>13} check"
    )
    rows: list[tuple[str, int, int]] = [(loop, 1024, 2) for loop in loops]
    rows += [(loop, 1024, 1) for loop in loops]
    rows += [("asyncio", kb, 2) for kb in (64, 256, 4096)]
    for loop, kb, workers in rows:
        cfg = demo.PipelineConfig(batches=batches, nbytes=kb * 1024, workers=workers, device=device)
        eff, speedup, peak, ok, slowest = real_time_pipeline(loop, cfg, repeats)
        print(
            f"   {loop:8} {f'{kb} KiB':>8} {workers:7} {slowest:>14} {eff:16.3f} "
            f"{speedup:12.2f}x {peak:>13} "
            f"{'ok' if ok else 'CHECKSUM MISMATCH'}"
        )
    print()


# ---------------------------------------------------------------------------- 2. workers


ITEM = 1 << 16  # float32s: 256 KiB, which stay in a core's cache while it works on them
COSTS_MS = (2, 5, 10, 20)  # host work per item
WARM_UP = 6  # items before the clock starts: the pipeline fills, the threads start


def cpu_work(a: np.ndarray, rounds: int) -> np.ndarray:
    """Compute-bound numpy work in ufunc loops, which release the GIL (about 0.2 ms a round
    for 256 KiB on the 2-core machine of RESULTS.md)."""
    out = np.empty_like(a)
    for _ in range(rounds):
        np.sin(a, out=out)
        np.cos(out, out=out)
    return out


def rounds_for(ms: float) -> int:
    a = np.random.default_rng(0).random(ITEM, dtype=np.float32)
    cpu_work(a, 10)
    start = time.perf_counter()
    cpu_work(a, 50)
    per_round = (time.perf_counter() - start) / 50
    return max(1, round(ms / 1000 / per_round))


def threads_alone(rounds: int, threads: int, items: int) -> float:
    """Items per second of the work in plain threads, no loader: what the cores allow."""
    base = np.random.default_rng(0).random(ITEM, dtype=np.float32)
    share = [items // threads + (i < items % threads) for i in range(threads)]
    pool = [
        threading.Thread(target=lambda n=n: [cpu_work(base, rounds) for _ in range(n)])
        for n in share
    ]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return items / (time.perf_counter() - start)


def workers_throughput(loop: str, rounds: int, workers: int, items: int) -> tuple[float, int, int]:
    """Items per second through the loader with ``workers`` workers (threads when > 1; one
    worker runs the transform on the loop's thread, the loader's default), once the pipeline
    is full (from the end of item ``WARM_UP``); peak and pool."""
    device = ais.Device("virtual", 0)
    base = np.random.default_rng(0).random(ITEM, dtype=np.float32)

    def transform(a: np.ndarray) -> np.ndarray:
        return cpu_work(a, rounds)

    async def main() -> tuple[float, int, int]:
        ais.virtual.reset()
        source = (base for _ in range(items))
        stream = ais.Stream(device)
        start = 0.0
        async with ais.DataLoader(
            source, transform=transform, device=device, workers=workers
        ) as loader:
            async for batch in loader:
                ais.delay(0.0001, stream=stream)  # the device is never the bottleneck
                if batch.index == WARM_UP - 1:
                    start = time.perf_counter()  # steady state: the pipeline is full
        await stream.synchronize()
        stats = loader.stats
        rate = (items - WARM_UP) / (time.perf_counter() - start)
        return rate, stats.peak_in_use, stats.pool_size

    return run_on(loop, main)


def section_workers(items: int, repeats: int, loops: list[str], costs: tuple[int, ...]) -> None:
    print(
        f"2. Real time: a CPU-bound numpy transform (sin/cos ufunc loops on 256 KiB items, the "
        f"GIL released) with workers, by its cost per item; {items} items, "
        f"{os.cpu_count()} cores; median of {repeats}"
    )
    print(
        f"   {'loop':8} {'cost/item':>9} {'threads alone 2/1':>18} {'workers=1':>10} "
        f"{'workers=2':>10} {'x w=1':>6} {'workers=4':>10} {'x w=1':>6} {'peak buffers':>13}"
    )
    for ms in costs:
        rounds = rounds_for(ms)
        alone = statistics.median(
            threads_alone(rounds, 2, items) / threads_alone(rounds, 1, items)
            for _ in range(repeats)
        )
        for loop in loops:
            # Interleaved, so that the machine's drift hits every worker count alike; the
            # ratios are the medians of each repeat's own ratios.
            runs = [
                {workers: workers_throughput(loop, rounds, workers, items) for workers in (1, 2, 4)}
                for _ in range(repeats)
            ]
            rate = {w: statistics.median(r[w][0] for r in runs) for w in (1, 2, 4)}
            ratio = {w: statistics.median(r[w][0] / r[1][0] for r in runs) for w in (2, 4)}
            peaks = " ".join(f"{max(r[w][1] for r in runs)}/{runs[0][w][2]}" for w in (1, 2, 4))
            print(
                f"   {loop:8} {f'{ms} ms':>9} {alone:17.2f}x {rate[1]:8.1f}/s "
                f"{rate[2]:8.1f}/s {ratio[2]:5.2f}x {rate[4]:8.1f}/s "
                f"{ratio[4]:5.2f}x {peaks:>13}"
            )
    print(
        f"   (items/s after the first {WARM_UP}; peak buffers: most slots in use / the pool, "
        "for workers 1, 2 and 4)"
    )
    print()


# ---------------------------------------------------------------------------- 3. virtual time


def measure_virtual(
    loop: str, batches: int, host_ms: float, copy_ms: float, compute_ms: float, prefetch: int
) -> tuple[demo.PipelineResult, demo.PipelineResult, float]:
    nbytes = 64 * 1024
    bandwidth = nbytes / (copy_ms / 1000 - LATENCY)
    cfg = demo.PipelineConfig(
        batches=batches,
        nbytes=nbytes,
        host_s=host_ms / 1000,
        compute_s=compute_ms / 1000,
        prefetch=prefetch,
        workers=1,  # the bound below is the host stage's own time
        device=ais.Device("virtual", 0),
    )
    options: dict[str, Any] = {"bandwidth": bandwidth, "latency": LATENCY}
    pipe = run_in_virtual_time(demo.run_pipeline, cfg, backend=loop, **options)
    seq = run_in_virtual_time(demo.run_sequential, cfg, backend=loop, **options)
    return pipe, seq, max(host_ms, copy_ms, compute_ms) / 1000


def section_virtual(batches: int, prefetch: int) -> None:
    print(f"3. Virtual time (exact), {batches} batches, prefetch {prefetch}, one worker")
    print(
        f"   {'loop':8} {'scenario':14} {'stages host/copy/compute ms':28} "
        f"{'pipelined/ideal':>16} {'sequential/(1/sum)':>19} {'peak buffers':>13} check"
    )
    for loop in ("asyncio", "trio"):  # uvloop cannot run on a fake clock
        for name, (host, copy, compute) in SCENARIOS.items():
            pipe, seq, slowest = measure_virtual(loop, batches, host, copy, compute, prefetch)
            ideal = 1 / slowest
            serial = 1 / ((host + 2 * copy + compute) / 1000)  # the d2h copy is a stage too
            ok = pipe.checksum_ok and seq.checksum_ok
            print(
                f"   {loop:8} {name:14} {f'{host:g} / {copy:g} (+{copy:g} d2h) / {compute:g}':28} "
                f"{pipe.batches_per_s / ideal:16.3f} {seq.batches_per_s / serial:19.3f} "
                f"{f'{pipe.peak_in_use} <= {prefetch + 2}':>13} "
                f"{'ok' if ok else 'CHECKSUM MISMATCH'}"
            )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--sections", default="1,2,3", help="which sections to run")
    parser.add_argument(
        "--costs", default=",".join(map(str, COSTS_MS)), help="section 2: host work per item, ms"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few batches, once")
    args = parser.parse_args()
    batches, repeats = (12, 1) if args.quick else (args.batches, args.repeats)
    loops = [loop for loop in args.loops.split(",") if loop]
    print(
        f"aiostream {ais.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} cores\n"
    )
    sections = set(args.sections.split(","))
    if "1" in sections:
        section_real_time(batches, repeats, loops)
    if "2" in sections:
        section_workers(
            12 if args.quick else 60,
            repeats,
            loops,
            COSTS_MS[:1] if args.quick else tuple(map(int, args.costs.split(","))),
        )
    if "3" in sections:
        section_virtual(20 if args.quick else 2 * batches, 2)


if __name__ == "__main__":
    main()
