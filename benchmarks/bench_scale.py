"""How the cost of waiting and of simulating grows with the load, from 100 to 100,000 streams.

Every figure is a ratio to a baseline measured in the same run.

1. Waits, in real time (the virtual backend on the monotonic clock): N streams, one operation
   each, completing one after another across a window (at least 1 s; longer above 20,000
   streams, so that neither side saturates the CPU); one task per stream awaits
   ``stream.synchronize()``. The baseline: N tasks sleeping on the loop's own timer
   (``anyio.sleep``) until the same moments have passed (sleeping again for the rest when a
   timer fires early, as uvloop's do by up to a millisecond: a wait may not resume early).
   CPU per wait is the process CPU time from
   starting the tasks to the last wake, over N (stream creation and submission are reported
   apart, as setup). Lateness is wake time minus completion time. Goals: CPU at most 3x the
   baseline's at every size; median lateness at most 2x the baseline's, or under 2 ms.
2. Memory per pending wait (tracemalloc, asyncio, a manual clock so that nothing completes
   while it is measured): everything one more pending ``await stream.synchronize()`` keeps,
   its task included, against a task sleeping on a timer. Goal: under 2 KiB.
3. The simulator alone, in virtual time (a manual ``VirtualClock``): N streams, each a pipeline
   of three dependent operations (a host-to-device copy, a kernel, a device-to-host copy) on
   engines with slots, submitted at once and then run to the end. Cost per operation, against
   SimPy running the same pipeline (one process per stream, one ``Resource`` per engine) in
   this run. Goals: at 100,000 streams at most 3x our own cost at 100, and at most 1x SimPy's.

Usage: python benchmarks/bench_scale.py [--loops asyncio,uvloop,trio] [--sizes 100,1000,...]
       [--quick] [--svg docs/scaling.svg]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from typing import Any

import aiostream as ais
from aiostream._bench.core import run_on
from aiostream._bench.scale import MIN_WINDOW, memory_per_wait, waits_base, waits_ours, window

SLOTS = {"h2d": 2, "compute": 4, "d2h": 2}  # the simulated pipeline's engines


# ------------------------------------------------- 1, 2: in aiostream/_bench/scale.py


# ---------------------------------------------------------------------- 3. the simulator


def durations(i: int) -> tuple[float, float, float]:
    """The pipeline's stage lengths for stream i, in seconds: varied, and repeatable."""
    return (2 + i % 3) * 1e-6, (5 + (i * 7) % 11) * 1e-6, (1 + i % 2) * 1e-6


def simulate_ours(n: int) -> tuple[float, float]:
    """(seconds per operation, simulated end) for the pipeline on N streams."""
    clock = ais.virtual.VirtualClock()
    ais.virtual.reset(
        clock=clock, h2d_slots=SLOTS["h2d"], compute_slots=SLOTS["compute"], d2h_slots=SLOTS["d2h"]
    )
    submit = ais.virtual.submit
    device = ais.device("virtual:0")
    gc.collect()
    t = time.perf_counter()
    streams = [ais.Stream(device) for _ in range(n)]
    for i, s in enumerate(streams):
        up, kernel, down = durations(i)
        submit(s, up, engine="h2d")
        submit(s, kernel)
        submit(s, down, engine="d2h")
    clock.advance(3600.0)
    cost = (time.perf_counter() - t) / (3 * n)
    assert ais.virtual.stats().operations == 0
    end = max(r.end for r in ais.virtual.timeline())
    ais.virtual.reset()
    return cost, end


def simulate_simpy(n: int) -> tuple[float, float]:
    """The same pipeline in SimPy: one process per stream, one Resource per engine."""
    import simpy

    gc.collect()
    t = time.perf_counter()
    env = simpy.Environment()
    engines = {name: simpy.Resource(env, capacity=k) for name, k in SLOTS.items()}

    def stream(i: int) -> Any:
        for engine, seconds in zip(("h2d", "compute", "d2h"), durations(i), strict=True):
            with engines[engine].request() as slot:
                yield slot
                yield env.timeout(seconds)

    for i in range(n):
        env.process(stream(i))
    env.run()
    return (time.perf_counter() - t) / (3 * n), env.now


# ---------------------------------------------------------------------- the picture


Series = tuple[str, str, str, list[tuple[int, float, float]]]


def svg(rows: list[Series], title: str, unit: str) -> str:
    """Log-log curves. Each series: (name, label of ours, label of the baseline, points of
    (size, ours, baseline)); ours solid, the baseline dashed, one colour per series."""
    import math

    w, h, left, right, top, bottom = 820, 380, 70, 280, 40, 50
    pts = [v for *_, series in rows for p in series for v in p[1:]]
    sizes = [p[0] for *_, series in rows for p in series]
    x0, x1 = math.log10(min(sizes)), math.log10(max(sizes))
    y0, y1 = math.floor(math.log10(min(pts))), math.ceil(math.log10(max(pts)))

    def x(v: float) -> float:
        return left + (math.log10(v) - x0) / max(x1 - x0, 1e-9) * (w - left - right)

    def y(v: float) -> float:
        return top + (y1 - math.log10(v)) / max(y1 - y0, 1e-9) * (h - top - bottom)

    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14">{title}</text>',
    ]
    for e in range(y0, y1 + 1):
        out.append(
            f'<line x1="{left}" x2="{w - right}" y1="{y(10**e):.1f}" '
            f'y2="{y(10**e):.1f}" stroke="#ddd"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{y(10**e) + 4:.1f}" text-anchor="end">{10**e:g} {unit}</text>'
        )
    for size in sorted(set(sizes)):
        out.append(
            f'<text x="{x(size):.1f}" y="{h - bottom + 18}" text-anchor="middle">{size:,}</text>'
        )
    out.append(
        f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">streams</text>'
    )
    for k, (name, ours, base, series) in enumerate(rows):
        colour = colours[k % len(colours)]
        for col, dash, label in ((1, "", ours), (2, ' stroke-dasharray="5,4"', base)):
            path = " ".join(f"{x(p[0]):.1f},{y(p[col]):.1f}" for p in series)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>'
            )
            ly = top + 16 * (2 * k + col - 1)
            out.append(
                f'<line x1="{w - right + 10}" x2="{w - right + 34}" y1="{ly}" y2="{ly}" '
                f'stroke="{colour}" stroke-width="2"{dash}/>'
            )
            out.append(f'<text x="{w - right + 38}" y="{ly + 4}">{name}, {label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", default="asyncio,uvloop,trio")
    parser.add_argument("--sizes", default="100,1000,10000,100000")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--svg", default=None, help="draw the curves to this file")
    args = parser.parse_args()
    loops = [name for name in args.loops.split(",") if name]
    sizes = [100, 300] if args.quick else [int(v) for v in args.sizes.split(",")]
    min_window = 0.1 if args.quick else MIN_WINDOW

    from importlib.metadata import version

    print(
        f"aiostream {ais.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {platform.system()} {platform.release()}, "
        f"anyio {version('anyio')}"
    )
    print(
        "1. waits, real time (virtual backend on the monotonic clock), one wait per stream, "
        "vs tasks sleeping on the loop timer until the same moments"
    )
    print("   goals: CPU per wait <= 3x; median lateness <= 2x or < 2 ms")
    print(
        f"   {'loop':8} {'streams':>8} {'window':>7} {'setup/stream':>12} {'CPU/wait ours':>14} "
        f"{'bare':>9} {'ratio':>6} {'median late ours':>17} {'bare':>9} {'p99 ours':>9} {'bare':>9}"
    )
    curves: dict[str, list[tuple[int, float, float]]] = {}
    for loop in loops:
        for n in sizes:
            setup, cpu, late = run_on(loop, lambda n=n: waits_ours(n, min_window))
            cpu_b, late_b = run_on(loop, lambda n=n: waits_base(n, min_window))
            med, med_b = statistics.median(late), statistics.median(late_b)
            p99 = sorted(late)[int(0.99 * (n - 1))]
            p99_b = sorted(late_b)[int(0.99 * (n - 1))]
            curves.setdefault(loop, []).append((n, cpu * 1e6, cpu_b * 1e6))
            print(
                f"   {loop:8} {n:8,} {window(n, min_window):6.1f}s {setup / n * 1e6:10.1f}us "
                f"{cpu * 1e6:12.1f}us {cpu_b * 1e6:7.1f}us {cpu / cpu_b:6.2f} "
                f"{med * 1e3:15.2f}ms {med_b * 1e3:7.2f}ms {p99 * 1e3:7.2f}ms {p99_b * 1e3:7.2f}ms",
                flush=True,
            )

    n_mem = max(sizes)
    ours_mem, base_mem = run_on("asyncio", lambda: memory_per_wait(n_mem))
    print(
        f"\n2. memory per pending wait, its task included, {n_mem:,} waits on asyncio "
        f"(goal: < 2 KiB): {ours_mem:,.0f} B ours, {base_mem:,.0f} B a task sleeping on a "
        f"timer ({ours_mem - base_mem:,.0f} B for the wait itself)"
    )

    print(
        "\n3. the simulator, virtual time: N streams of h2d -> kernel -> d2h on "
        f"{SLOTS} slots, cost per operation vs SimPy (goals: <= 3x ours at the smallest "
        "size; <= 1x SimPy)"
    )
    sim: list[tuple[int, float, float]] = []
    try:
        import simpy  # noqa: F401

        have_simpy = True
    except ImportError:
        have_simpy = False
        print("   (SimPy is not installed: python -m pip install '.[bench]' to compare)")
    for n in sizes:
        ours, end = simulate_ours(n)
        growth = ours / (sim[0][1] * 1e-6) if sim else 1.0
        line = f"   {n:8,} streams: ours {ours * 1e6:6.2f} us/op (x{growth:4.2f} of the first size)"
        if have_simpy:
            base, end_b = simulate_simpy(n)
            sim.append((n, ours * 1e6, base * 1e6))
            line += f", SimPy {base * 1e6:6.2f} us/op, ratio {ours / base:4.2f}"
            line += f"; simulated end {end * 1e3:.3f} ms vs SimPy's {end_b * 1e3:.3f} ms"
        else:
            sim.append((n, ours * 1e6, ours * 1e6))
        print(line, flush=True)

    if args.svg:
        rows: list[Series] = [
            (loop, "CPU per wait", "task on a timer", pts) for loop, pts in curves.items()
        ]
        if have_simpy:
            rows.append(("simulator", "per operation", "SimPy", sim))
        with open(args.svg, "w") as f:
            f.write(
                svg(rows, "aiostream at scale: cost per wait and per simulated operation", "us")
            )
        print(f"\nwrote {args.svg}")


if __name__ == "__main__":
    main()
