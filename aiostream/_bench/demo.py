"""The demos behind ``python -m aiostream demo`` and ``streams``, and the loader benchmark's
pipeline.

The pipeline: a synthetic dataset goes through a host transform, host-to-device copies, compute
(``ais.delay`` standing in for a model, which then copies the batch to its output buffer) and
device-to-host copies of the outputs on a download stream, which are checked against the same
computation done on the host.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
import numpy as np

import aiostream as ais

__all__ = [
    "PipelineConfig",
    "PipelineResult",
    "batch_buffers",
    "bound",
    "run_pipeline",
    "run_sequential",
    "streams_demo",
]


@dataclass(frozen=True)
class PipelineConfig:
    batches: int = 100
    nbytes: int = 1 << 20
    host_s: float = 0.002
    compute_s: float = 0.003
    prefetch: int | None = None
    """Items the loader works on ahead; None: the loader's default, ``2 x workers``."""
    workers: int = 2
    """Host transforms at once: the host stage (2.7 ms as measured on a 2-core machine, most
    of it an async sleep) is within 10% of compute, so one worker leaves the device waiting
    whenever the loop is late; two keep it fed."""
    device: ais.Device | None = None


@dataclass(frozen=True)
class PipelineResult:
    seconds: float
    """Wall (or virtual) seconds from the first item to the last result checked."""
    batches: int
    checksum_ok: bool
    stage_s: dict[str, float]
    """Seconds per batch of each stage (measured by the sequential run, else given)."""
    peak_in_use: int = 0
    pool_size: int = 0
    workers: int = 1
    """Host transforms at once in the pipelined run."""
    loop_cpu_s: float = 0.0
    """CPU seconds per batch of the event loop's thread (pipelined run): the host work no
    stage shows alone (staging, checking results, the loop's and the simulator's own costs),
    which cannot overlap itself. Meaningful in real time only."""

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds

    @property
    def per_batch_s(self) -> dict[str, float]:
        """Seconds each stage adds per batch when stages overlap: the host stage's time is
        shared by ``workers`` transforms at once, each device stage's is its own."""
        return {
            name: sec / self.workers if name == "host" else sec
            for name, sec in self.stage_s.items()
        }


def bound(seq: PipelineResult, pipe: PipelineResult) -> tuple[str, float]:
    """The bottleneck of a real-time pipeline and its seconds per batch: the slowest stage
    as the sequential run measured it, or the loop thread's CPU in the pipelined run."""
    per_batch = {**seq.per_batch_s, "event loop CPU": pipe.loop_cpu_s}
    name = max(per_batch, key=per_batch.__getitem__)
    return name, per_batch[name]


def batch_buffers(prefetch: int, workers: int) -> int:
    """How many batch-sized buffers and arrays :func:`run_pipeline` holds at most with the
    loader's ``prefetch`` and ``workers``: the loader's ``prefetch + 2`` slots (a host staging
    buffer and a device buffer each), the pipeline's ``prefetch + 1`` outputs (a device buffer
    and a host buffer each), up to ``prefetch`` items taken from the source, the transformed
    arrays of ``workers`` transforms at once, and the dataset's base array. The sequential run
    holds fewer."""
    return 2 * (prefetch + 2) + 2 * (prefetch + 1) + prefetch + workers + 1


def _dataset(cfg: PipelineConfig) -> Iterator[np.ndarray]:
    n = cfg.nbytes // 4
    base = np.arange(n, dtype=np.float32) % 251
    for i in range(cfg.batches):
        yield base + np.float32(i % 7)


def _host_math(a: np.ndarray) -> np.ndarray:
    return a * np.float32(0.5) + np.float32(1.0)


def _expected(cfg: PipelineConfig) -> float:
    return float(sum(float(_host_math(a).sum(dtype=np.float64)) for a in _dataset(cfg)))


async def _transform(cfg: PipelineConfig, a: np.ndarray) -> np.ndarray:
    async with ais.record_function("transform"):
        out = _host_math(a)
        await anyio.sleep(cfg.host_s)  # heavier preprocessing, as a chosen duration
        return out


async def run_pipeline(
    cfg: PipelineConfig, progress: Callable[[int], None] | None = None
) -> PipelineResult:
    """The overlapped pipeline: DataLoader, compute, and results copied back and checked."""
    device = ais.device(cfg.device)
    compute = ais.Stream(device, name="compute")
    download = ais.Stream(device, name="d2h copies")

    async def transform(a: np.ndarray) -> np.ndarray:
        return await _transform(cfg, a)

    loader = ais.DataLoader(
        _dataset(cfg),
        transform=transform,
        device=device,
        prefetch=cfg.prefetch,
        workers=cfg.workers,
    )
    depth = loader.prefetch + 1  # outputs in flight, as many as the loader's batches
    outputs = [ais.DeviceBuffer(cfg.nbytes, device) for _ in range(depth)]
    ring = [ais.HostBuffer(cfg.nbytes, device=device) for _ in range(depth)]
    pending: list[ais.Event | None] = [None] * depth
    total = 0.0

    async def collect(slot: int) -> float:
        event = pending[slot]
        if event is None:
            return 0.0
        await event.synchronize()
        pending[slot] = None
        return float(ring[slot].numpy(np.float32).sum(dtype=np.float64))

    start, cpu = anyio.current_time(), time.thread_time()
    with ais.use_stream(compute):
        async with loader:
            async for batch in loader:
                slot = batch.index % depth
                total += await collect(slot)  # this slot's output and host buffers are free
                with ais.record_function("model", stream=compute, batch=batch.index):
                    ais.delay(cfg.compute_s, stream=compute)  # the model ...
                    ais.copy_async(outputs[slot], batch.data, stream=compute)  # ... its output
                download.wait_event(compute.record_event())
                ais.copy_async(ring[slot], outputs[slot], stream=download)
                pending[slot] = download.record_event()
                if progress is not None:
                    progress(batch.index + 1)
        for slot in range(depth):
            total += await collect(slot)
    seconds, cpu = anyio.current_time() - start, time.thread_time() - cpu
    stats = loader.stats
    return PipelineResult(
        seconds=seconds,
        batches=cfg.batches,
        checksum_ok=abs(total - _expected(cfg)) <= 1e-6 * max(1.0, abs(total)),
        stage_s={},
        peak_in_use=stats.peak_in_use,
        pool_size=stats.pool_size,
        workers=cfg.workers,
        loop_cpu_s=cpu / cfg.batches,
    )


async def run_sequential(cfg: PipelineConfig) -> PipelineResult:
    """The same work with no overlap: each stage waits for the one before.

    It also times each stage: the host stage on the host clock, the device stages with timing
    events (exact on virtual devices, device-timed on CUDA).
    """
    device = ais.device(cfg.device)
    stream = ais.Stream(device)
    host = ais.HostBuffer(cfg.nbytes, device=device)
    dev = ais.DeviceBuffer(cfg.nbytes, device)
    output = ais.DeviceBuffer(cfg.nbytes, device)
    out = ais.HostBuffer(cfg.nbytes, device=device)
    spent = {"host": 0.0, "h2d": 0.0, "compute": 0.0, "d2h": 0.0}
    # The first of each pair is recorded on the idle stream just before the stage's work, so
    # the pair spans the work itself, not the host's wake-up before it.
    marks = {
        name: (ais.Event(device, enable_timing=True), ais.Event(device, enable_timing=True))
        for name in ("h2d", "compute", "d2h")
    }

    async def timed(name: str, *ops: Callable[[], object]) -> None:
        """One device stage alone on the idle stream, between its pair of timing events."""
        begin, end = marks[name]
        begin.record(stream)
        for op in ops:
            op()
        end.record(stream)
        await stream.synchronize()
        spent[name] += begin.elapsed_time(end) / 1000

    total = 0.0
    start = anyio.current_time()
    items = _dataset(cfg)
    while True:
        t = anyio.current_time()
        a = next(items, None)  # making the item is host work too
        if a is None:
            break
        np.copyto(host.numpy(np.float32), await _transform(cfg, a))
        spent["host"] += anyio.current_time() - t
        await timed("h2d", lambda: ais.copy_async(dev, host, stream=stream))
        await timed(
            "compute",
            lambda: ais.delay(cfg.compute_s, stream=stream),
            lambda: ais.copy_async(output, dev, stream=stream),
        )
        await timed("d2h", lambda: ais.copy_async(out, output, stream=stream))
        total += float(out.numpy(np.float32).sum(dtype=np.float64))
    seconds = anyio.current_time() - start
    return PipelineResult(
        seconds=seconds,
        batches=cfg.batches,
        checksum_ok=abs(total - _expected(cfg)) <= 1e-6 * max(1.0, abs(total)),
        stage_s={name: s / cfg.batches for name, s in spent.items()},
        workers=cfg.workers,
    )


def redraw(line: str) -> str:
    """``line`` redrawn over the terminal's current line: cut to the terminal's width (a line
    that wrapped could not be drawn over) and the rest of the old line erased."""
    columns = shutil.get_terminal_size().columns
    return f"\r{line[: max(1, columns - 1)]}\x1b[K"


def progress_bar(total: int, out: Callable[[str], None], *, live: bool) -> Callable[[int], None]:
    """A text progress bar: redrawn in place on a terminal, every quarter otherwise."""
    width = 30
    started = time.perf_counter()

    def show(done: int) -> None:
        if not live and done % max(1, total // 4) and done != total:
            return
        filled = round(width * done / total)
        rate = done / max(1e-9, time.perf_counter() - started)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} batches, {rate:6.1f}/s"
        out(redraw(line) if live else (line + "\n"))

    return show


def columns() -> int:
    """The terminal's width ($COLUMNS first), 80 when the output is no terminal."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


async def streams_demo(device: ais.Device, tasks: int, base_ms: float, out: list[str]) -> None:
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
            (
                i,
                s,
                (ran[s.stream_id].start - origin) * 1000,
                (ran[s.stream_id].end - origin) * 1000,
                w,
            )
            for i, s, _, _, w in rows
        ]
        what = "as run on the compute engine"
    horizon = max(end for _, _, _, end, _ in rows) or 1.0
    # each label's column is as wide as its widest (its numbers right-aligned); the bar takes
    # what the terminal has left, 10 columns at the least and 50 at the most
    tasks_w = len(str(len(rows) - 1))
    ids_w = max(3, *(len(str(s.stream_id)) for _, s, _, _, _ in rows))
    starts = [f"{start:.2f}" for _, _, start, _, _ in rows]
    ends = [f"{end:.2f}" for _, _, _, end, _ in rows]
    starts_w, ends_w = max(7, *map(len, starts)), max(7, *map(len, ends))
    fixed = len("  task ") + len(" stream ") + len(" |") + len("| ") + len(" .. ") + len(" ms")
    width = max(10, min(50, columns() - fixed - tasks_w - ids_w - starts_w - ends_w))
    out.append("")
    out.append(f"device timeline on {device}, {what} (0 to {horizon:.1f} ms):")
    for (i, stream, start, end, _), start_ms, end_ms in zip(rows, starts, ends, strict=True):
        a = min(width - 1, round(start / horizon * width))  # a bar is one column at the least
        b = max(a + 1, round(end / horizon * width))
        bar = " " * a + "#" * (b - a) + " " * (width - b)
        out.append(
            f"  task {i:>{tasks_w}} stream {stream.stream_id:>{ids_w}} |{bar}| "
            f"{start_ms:>{starts_w}} .. {end_ms:>{ends_w}} ms"
        )
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
