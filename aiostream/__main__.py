"""The command line: ``python -m aiostream info`` and ``python -m aiostream demo``."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import time
from collections.abc import Sequence

import anyio

import aiostream as ais

from . import _backends

LOOPS = ("asyncio", "uvloop", "trio")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def info() -> str:
    """What this machine offers aiostream: versions, loops, backends and devices."""
    lines = [f"aiostream {ais.__version__} (Python {platform.python_version()})"]
    for dist in ("anyio", "cuda-python"):
        lines.append(f"  {dist}: {_dist_version(dist) or 'not installed'}")
    loops = ["asyncio (built in)"]
    for name in ("uvloop", "trio"):
        v = _dist_version(name)
        loops.append(f"{name} {v}" if v else f"{name} (not installed)")
    lines.append("loops: " + ", ".join(loops))
    lines.append("backends:")
    for kind in ("virtual", "cuda"):
        ok, reason = _backends.probe(kind)
        if ok:
            n = ais.device_count(kind)
            names = ", ".join(f"{kind}:{i}" for i in range(n))
            lines.append(f"  {kind:8} available, {n} device{'s' if n != 1 else ''}: {names}")
        else:
            lines.append(f"  {kind:8} unavailable: {reason}")
    try:
        lines.append(f"default device: {ais.device()}")
    except (ValueError, ais.AiostreamError) as exc:
        lines.append(f"default device: none ({exc})")
    return "\n".join(lines)


async def demo(device: ais.Device, tasks: int, base_ms: float, out: list[str]) -> None:
    """Several tasks, each recording work on its own stream and awaiting it."""
    t0 = ais.Event(device, enable_timing=True)
    t0.record(ais.default_stream(device))
    t0_device = ais.virtual.now() if device.type == "virtual" else 0.0
    wall0 = time.perf_counter()
    spans: list[tuple[int, ais.Stream, float, float, float]] = []

    async def worker(i: int) -> None:
        stream = ais.Stream(device)
        start = ais.Event(device, enable_timing=True)
        end = ais.Event(device, enable_timing=True)
        duration = base_ms * (tasks - i) / 1000
        start.record(stream)
        ais.delay(duration, stream=stream)
        end.record(stream)
        out.append(f"task {i}: submitted {duration * 1000:.0f} ms of work on {stream!r}")
        await end.synchronize()  # suspends this task only
        resumed = (time.perf_counter() - wall0) * 1000
        out.append(f"task {i}: resumed at {resumed:8.2f} ms (wall clock)")
        spans.append((i, stream, t0.elapsed_time(start), t0.elapsed_time(end), resumed))

    async with anyio.create_task_group() as tg:
        for i in range(tasks):
            tg.start_soon(worker, i)

    rows = sorted(spans, key=lambda s: s[0])
    what = "from the start and end events"
    if device.type == "virtual":
        # The simulator knows when each operation really ran on its engine.
        origin = t0_device
        ran = {r.stream: r for r in ais.virtual.timeline() if r.device == device.index}
        rows = [
            (i, s, (ran[s.stream_id].start - origin) * 1000, (ran[s.stream_id].end - origin) * 1000, w)
            for i, s, _, _, w in rows
        ]
        what = "as run on the compute engine"
    horizon = max(end for _, _, _, end, _ in rows) or 1.0
    width = 50
    out.append("")
    out.append(f"device timeline on {device}, {what} (0 to {horizon:.1f} ms):")
    for i, stream, start, end, _ in rows:
        a = round(start / horizon * width)
        b = max(a + 1, round(end / horizon * width))
        bar = " " * a + "#" * (b - a) + " " * (width - b)
        out.append(f"  task {i} stream {stream.stream_id:>3} |{bar}| {start:7.2f} .. {end:7.2f} ms")
    out.append("")
    out.append(
        "Each task awaited its own event; the loop stayed free, and each resumed as its work "
        "completed."
    )
    if device.type == "virtual":
        out.append(
            "The virtual device's compute engine runs one operation at a time by default "
            "(aiostream.virtual.reset(compute_slots=N) gives it more), so the streams' work "
            "queues there in submission order."
        )


def _run(main: object, loop: str) -> None:
    if loop == "trio":
        anyio.run(main, backend="trio")  # type: ignore[arg-type]
    else:
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiostream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends, devices and versions on this machine")
    p_demo = sub.add_parser("demo", help="tasks awaiting device work on their own streams")
    p_demo.add_argument("--device", default=None, help="device, e.g. virtual:0 (default: auto)")
    p_demo.add_argument("--tasks", type=int, default=4, help="number of tasks (default 4)")
    p_demo.add_argument(
        "--duration-ms", type=float, default=40.0, help="work per task unit, ms (default 40)"
    )
    p_demo.add_argument("--loop", choices=LOOPS, default="asyncio", help="event loop")
    args = parser.parse_args(argv)

    if args.command == "info":
        print(info())
        return 0

    if args.tasks < 1:
        parser.error("--tasks must be >= 1")
    if not args.duration_ms > 0:
        parser.error("--duration-ms must be > 0")
    try:
        device = ais.device(args.device)
    except (ValueError, TypeError, ais.AiostreamError) as exc:
        parser.error(str(exc))
    if args.loop != "asyncio" and _dist_version(args.loop) is None:
        parser.error(f"--loop {args.loop} needs the {args.loop!r} package: pip install {args.loop}")
    out: list[str] = []
    print(f"aiostream demo on {device}, {args.tasks} tasks, {args.loop} loop")

    async def run() -> None:
        await demo(device, args.tasks, args.duration_ms, out)

    _run(run, args.loop)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
