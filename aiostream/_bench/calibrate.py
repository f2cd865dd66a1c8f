"""``python -m aiostream calibrate``: measure a CUDA device and write a profile of it, from
which a virtual device takes its time model; ``--check``: run one reference workload on the
device and on virtual devices (the profile's, and the default one) and say how far apart
their timelines are.

Every device time here is read from timing events around the work, on the device's own
clock: what a figure includes is what the events bracket. Work timed queued behind a holding
kernel is the device's time alone (pinned and device-to-device copies, the gap between
kernels); work timed on an idle stream includes the calls' cost (a kernel's launch overhead,
a pageable copy's staging), which the model then puts between a submission and its start.
"""

from __future__ import annotations

import datetime
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TextIO

import anyio

import aiostream as ais

from .._backends import get as _get_backend
from .._backends.virtual.profile import COPY_KINDS, FIGURES, DeviceProfile, Figure
from .._virtual_time import run_in_virtual_time
from .suite import Progress

__all__ = [
    "FULL",
    "QUICK",
    "Agreement",
    "Plan",
    "agreement",
    "agreement_report",
    "calibrate",
    "reference_workload",
]


@dataclass(frozen=True)
class _Step:
    label: str
    seconds: float  # about how long it takes: the progress bar's weight
    run: Callable[[], dict[str, Figure]]


@dataclass(frozen=True)
class Plan:
    """What to measure: copy sizes, repeats, how many kernels and copies at once."""

    sizes: tuple[int, ...]
    repeats: int
    kernels: tuple[int, ...]
    copies: tuple[int, ...]
    copy_bytes: int
    check_runs: int


FULL = Plan(
    sizes=(4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20),
    repeats=5,
    kernels=(1, 2, 4, 8, 16, 32, 64, 128),
    copies=(1, 2, 4, 8),
    copy_bytes=16 << 20,
    check_runs=3,
)
QUICK = Plan(
    sizes=(4 << 10, 256 << 10, 4 << 20),
    repeats=3,
    kernels=(1, 2, 4, 8, 16),
    copies=(1, 2, 4),
    copy_bytes=1 << 20,
    check_runs=1,
)

#: long enough that the next call (the event after it) is made before it ends
_SHORT_KERNEL_S = 500e-6
_WIDE_KERNEL_S = 2e-3  # the kernels run at once: long beside their launches


def _timing(device: ais.Device) -> ais.Event:
    return ais.Event(device, enable_timing=True)


#: how long a stream is held busy so that the calls after it queue behind it
_HOLD_S = 0.005


def _timed(stream: ais.Stream, submit: Callable[[], object], queued: bool = False) -> float:
    """Device seconds between timing events recorded on ``stream`` before and after
    ``submit()``: on an idle stream, the calls' cost included; ``queued``, behind a kernel
    that holds the stream meanwhile, the device's time alone."""
    before, after = _timing(stream.device), _timing(stream.device)
    if queued:
        ais.delay(_HOLD_S, stream=stream)
    before.record(stream)
    submit()
    after.record(stream)
    after.synchronize_blocking()
    return before.elapsed_time(after) / 1e3


def _figure(samples: Sequence[float]) -> Figure:
    """The median of ``samples`` (at least 0: a time), spread half their range."""
    return Figure(max(0.0, statistics.median(samples)), (max(samples) - min(samples)) / 2)


# ---------------------------------------------------------------------- copies


def _buffers(device: ais.Device, kind: str, nbytes: int) -> tuple[Any, Any]:
    """(destination, source) of a copy of ``kind`` (``COPY_KINDS``)."""
    pinned = kind.endswith("_pinned")
    if kind == "d2d":
        return ais.DeviceBuffer(nbytes, device=device), ais.DeviceBuffer(nbytes, device=device)
    host = ais.HostBuffer(nbytes, pinned=pinned, device=device)
    dev = ais.DeviceBuffer(nbytes, device=device)
    return (dev, host) if kind.startswith("h2d") else (host, dev)


def fit(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float, float]:
    """(latency, bandwidth, largest relative error) of ``seconds = latency + size /
    bandwidth``, fitted by least squares on relative errors (sizes span five orders of
    magnitude: each counts alike), with latency at least 0."""
    w = [1 / t for t in seconds]
    # minimise sum((a + b x - t) / t)^2 over a >= 0, b > 0: the normal equations of 2x2
    sww = sum(wi * wi for wi in w)
    swx = sum(wi * wi * x for wi, x in zip(w, sizes, strict=True))
    sxx = sum(wi * wi * x * x for wi, x in zip(w, sizes, strict=True))
    swt = sum(wi * wi * t for wi, t in zip(w, seconds, strict=True))
    sxt = sum(wi * wi * x * t for wi, x, t in zip(w, sizes, seconds, strict=True))
    det = sww * sxx - swx * swx
    a = (swt * sxx - swx * sxt) / det if det else 0.0
    if a < 0 or not det:
        a = 0.0
    b = (sxt - a * swx) / sxx
    b = max(b, 1e-30)
    error = max(abs(a + b * x - t) / t for x, t in zip(sizes, seconds, strict=True))
    return a, 1 / b, error


def _copies(device: ais.Device, plan: Plan, kind: str) -> dict[str, Figure]:
    """A copy's latency and bandwidth. From pinned memory, and device to device, timed
    queued behind other work, as a pipeline runs them: the device's time alone. From pageable
    memory, on an idle stream: the call stages the bytes (or waits for them), and that cost
    is the copy's, in its latency and bandwidth."""
    stream = ais.Stream(device)
    medians: list[float] = []
    lows: list[float] = []
    highs: list[float] = []
    for nbytes in plan.sizes:
        dst, src = _buffers(device, kind, nbytes)
        ais.copy_async(dst, src, stream=stream)  # the first copy of a buffer warms its pages
        queued = not kind.endswith("_pageable")
        runs = [
            _timed(stream, partial(ais.copy_async, dst, src, stream=stream), queued)
            for _ in range(plan.repeats)
        ]
        medians.append(statistics.median(runs))
        lows.append(min(runs))
        highs.append(max(runs))
        del dst, src
    latency, bandwidth, error = fit(plan.sizes, medians)
    big = plan.sizes[-1]
    spread_bw = abs(big / max(lows[-1] - latency, 1e-12) - big / max(highs[-1] - latency, 1e-12))
    return {
        f"{kind}_latency_s": Figure(latency, (highs[0] - lows[0]) / 2),
        f"{kind}_bandwidth": Figure(bandwidth, spread_bw / 2),
        f"{kind}_fit_error": Figure(error, 0.0),
    }


# ---------------------------------------------------------------------- kernels and engines


def _launch(device: ais.Device, plan: Plan) -> dict[str, Figure]:
    stream = ais.Stream(device)
    k = _SHORT_KERNEL_S
    ais.delay(k, stream=stream)  # the sleep kernel's module loads on first use
    stream.synchronize_blocking()
    launch = [
        _timed(stream, partial(ais.delay, k, stream=stream)) - k for _ in range(plan.repeats * 4)
    ]
    n = 50
    gaps = []
    for _ in range(plan.repeats):
        ais.delay(0.02, stream=stream)  # the kernels queue behind it: back to back

        def queued() -> None:
            for _ in range(n):
                ais.delay(k, stream=stream)

        gaps.append((_timed(stream, queued) - n * k) / n)
    records = []
    for _ in range(plan.repeats):
        records.append(_timed(stream, partial(_record_many, stream, 20)) / 21)
    return {
        "launch_s": _figure(launch),
        "gap_s": _figure(gaps),
        "event_record_s": _figure(records),
    }


def _record_many(stream: ais.Stream, n: int) -> None:
    for _ in range(n):
        ais.Event(stream.device).record(stream)


def _at_once(
    device: ais.Device, counts: Sequence[int], submit: Callable[[ais.Stream], object], one: float
) -> Figure:
    """How many of ``submit``'s operations (each ``one`` seconds alone) run at once: for each
    count, that many on as many streams, released together by one event; the most that ran
    at once, rounded, is the figure (at most the largest count tried)."""
    streams = [ais.Stream(device) for _ in range(max(counts))]
    gate_stream = ais.Stream(device)
    best = 1.0
    for count in counts:
        ais.delay(0.005 + count * 300e-6, stream=gate_stream)  # longer than the submissions
        gate = _timing(device)
        gate.record(gate_stream)
        ends = []
        for s in streams[:count]:
            s.wait_event(gate)
            submit(s)
            ends.append(s.record_event(_timing(device)))
        for e in ends:
            e.synchronize_blocking()
        took = max(gate.elapsed_time(e) for e in ends) / 1e3
        best = max(best, min(count, count * one / took))
    return Figure(float(max(1, round(best))), 0.0)


def _engines(device: ais.Device, plan: Plan) -> dict[str, Figure]:
    out = {
        "compute_slots": _at_once(
            device, plan.kernels, partial(_delay_on, _WIDE_KERNEL_S), _WIDE_KERNEL_S
        )
    }
    for direction in ("h2d", "d2h"):
        kind = f"{direction}_pinned"
        pairs = [_buffers(device, kind, plan.copy_bytes) for _ in range(max(plan.copies))]
        stream = ais.Stream(device)
        one = statistics.median(  # the device's time alone, as the gated copies' is
            _timed(stream, partial(ais.copy_async, *pairs[0], stream=stream), queued=True)
            for _ in range(plan.repeats)
        )
        it = itertools.count()

        def copy(s: ais.Stream, pairs: list[tuple[Any, Any]] = pairs, it: Any = it) -> None:
            dst, src = pairs[next(it) % len(pairs)]
            ais.copy_async(dst, src, stream=s)

        out[f"{direction}_slots"] = _at_once(device, plan.copies, copy, one)
    return out


def _delay_on(seconds: float, stream: ais.Stream) -> None:
    ais.delay(seconds, stream=stream)


def _host_fn(device: ais.Device, plan: Plan, launch: float) -> dict[str, Figure]:
    """From a kernel's end to the waiting task's wake-up, the end placed on the host's clock
    by the launch overhead just measured: what a waiter woken by the driver's thread sees."""
    stream = ais.Stream(device)
    k = 1e-3

    async def wakes() -> list[float]:
        out = []
        for _ in range(plan.repeats * 2):
            t0 = time.perf_counter()
            ais.delay(k, stream=stream)
            await stream.synchronize(strategy="callback")
            out.append(time.perf_counter() - t0 - k - launch)
        return out

    return {"host_fn_s": _figure(anyio.run(wakes))}


# ---------------------------------------------------------------------- the whole


def _driver() -> str:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found,unused-ignore]

        err, version = driver.cuDriverGetVersion()
        if int(err) == 0:
            return f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001 - a name in a file: "unknown" rather than no profile
        pass
    return "unknown"


def calibrate(device: ais.Device, plan: Plan, progress: TextIO) -> DeviceProfile:
    """Measure ``device`` (a CUDA device) by ``plan``, with a progress bar on ``progress``."""
    figures: dict[str, Figure] = {}
    copy_s = sum(plan.sizes) * (plan.repeats + 1) / 10e9 + 0.05 * len(plan.sizes)
    todo = [_Step("kernel launch", 0.1 * plan.repeats, partial(_launch, device, plan))]
    todo += [
        _Step(f"copies {kind}", copy_s, partial(_copies, device, plan, kind)) for kind in COPY_KINDS
    ]
    todo.append(
        _Step("engines at once", 0.05 * len(plan.kernels) + 0.2, partial(_engines, device, plan))
    )
    bar = Progress(todo, progress)
    for i, step in enumerate(todo):
        with bar.running(i):
            figures.update(step.run())
    figures.update(_host_fn(device, plan, figures["launch_s"].value))
    bar.show(len(todo))
    backend = _get_backend("cuda")
    return DeviceProfile(
        name=backend.device_name(device.index),
        driver=_driver(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        measured_on=str(device),
        figures=figures,
    )


# ---------------------------------------------------------------------- agreement


@dataclass(frozen=True)
class Op:
    name: str
    start: float
    end: float


#: The reference workload: device-bound (a batch's kernel and copies take several times what
#: the host spends on its calls, even where a driver call costs 100 us), as pipelines are meant
#: to be; the model times the device, not the host's calls.
_BATCHES, _NBYTES, _KERNEL_S, _HOST_S, _GATE_S = 8, 4 << 20, 20e-3, 0.5e-3, 10e-3


async def reference_workload(device: ais.Device | str | None = None) -> list[Op]:
    """The demo's pipeline, scripted: for each batch a host transform (a sleep), a copy in,
    a kernel and a device-to-device copy on one of two compute streams, a copy out; each
    operation between timing events. The operations' device times from the pipeline's start
    (the end of a gate kernel that gives the host the time to submit its first batches)."""
    dev = ais.device(device)
    s_in, s_out = ais.Stream(dev), ais.Stream(dev)
    computes = [ais.Stream(dev), ais.Stream(dev)]
    # allocated first: the workload times the device's work, not the allocator
    hosts = [(ais.HostBuffer(_NBYTES, device=dev), ais.HostBuffer(_NBYTES, device=dev))]
    hosts += [(ais.HostBuffer(_NBYTES, device=dev), ais.HostBuffer(_NBYTES, device=dev))]
    devs = [(ais.DeviceBuffer(_NBYTES, device=dev), ais.DeviceBuffer(_NBYTES, device=dev))]
    devs += [(ais.DeviceBuffer(_NBYTES, device=dev), ais.DeviceBuffer(_NBYTES, device=dev))]
    for c in computes:  # first uses (the sleep kernel's module, each copy's path) before t0
        ais.delay(0.0, stream=c)
        ais.copy_async(devs[0][1], devs[0][0], stream=c)
    ais.copy_async(devs[0][0], hosts[0][0], stream=s_in)
    ais.copy_async(hosts[0][1], devs[0][1], stream=s_out)
    for warm in (s_in, s_out, *computes):
        await warm.synchronize()
    marks: list[tuple[str, ais.Event, ais.Event]] = []

    def op(name: str, stream: ais.Stream, submit: Callable[[], object]) -> ais.Event:
        before, after = _timing(dev), _timing(dev)
        before.record(stream)
        submit()
        after.record(stream)
        marks.append((name, before, after))
        return after

    # the pipeline starts on the device once the host has had the time to submit its first
    # batches (a gate kernel, then the pipeline's time 0): from then on the device's work, not
    # the host's pace or its calls' cost, sets every start
    ais.delay(_GATE_S, stream=s_in)
    t0 = _timing(dev)
    t0.record(s_in)

    for i in range(_BATCHES):
        await anyio.sleep(_HOST_S)
        (host_in, host_out), (dev_in, dev_out) = hosts[i % 2], devs[i % 2]
        if i >= 2:  # two batches ago used these buffers: its copy out must have ended
            s_in.wait_event(marks[4 * (i - 2) + 3][2])
        landed = op(f"h2d {i}", s_in, partial(ais.copy_async, dev_in, host_in, stream=s_in))
        c = computes[i % 2]
        c.wait_event(landed)
        op(f"kernel {i}", c, partial(ais.delay, _KERNEL_S, stream=c))
        done = op(f"d2d {i}", c, partial(ais.copy_async, dev_out, dev_in, stream=c))
        s_out.wait_event(done)
        op(f"d2h {i}", s_out, partial(ais.copy_async, host_out, dev_out, stream=s_out))
    await s_out.synchronize()
    for c in computes:
        await c.synchronize()
    return [Op(name, t0.elapsed_time(a) / 1e3, t0.elapsed_time(b) / 1e3) for name, a, b in marks]


@dataclass(frozen=True)
class Agreement:
    """How far a virtual device's timeline of the reference workload is from the device's."""

    total: float
    """End-to-end seconds on the virtual device."""
    total_error: float
    """(virtual - device) / device, of the end-to-end seconds."""
    start_error: float
    """Median over the operations of |start difference| / the operation's duration."""
    ops: list[tuple[Op, Op]]
    """(device, virtual), each operation."""

    def met(self) -> bool:
        return abs(self.total_error) <= 0.05 and self.start_error <= 0.10


def agreement(device_ops: list[Op], virtual_ops: list[Op]) -> Agreement:
    total = max(o.end for o in device_ops)
    vtotal = max(o.end for o in virtual_ops)
    errors = [
        abs(v.start - d.start) / max(d.end - d.start, 1e-9)
        for d, v in zip(device_ops, virtual_ops, strict=True)
    ]
    return Agreement(
        vtotal,
        (vtotal - total) / total,
        statistics.median(errors),
        list(zip(device_ops, virtual_ops, strict=True)),
    )


def _on_device(device: ais.Device, runs: int) -> list[Op]:
    """The run whose end-to-end time is the median of ``runs``."""
    results = [anyio.run(reference_workload, device) for _ in range(runs)]
    results.sort(key=lambda ops: max(o.end for o in ops))
    return results[len(results) // 2]


def check(device: ais.Device, profile: DeviceProfile, plan: Plan) -> dict[str, Any]:
    """The reference workload on ``device``, on a virtual device made from ``profile``, and
    on the default virtual device."""
    measured = _on_device(device, plan.check_runs)
    calibrated = run_in_virtual_time(reference_workload, "virtual:0", profile=profile)
    default = run_in_virtual_time(reference_workload, "virtual:0", profile=False)
    return {
        "device": measured,
        "calibrated": agreement(measured, calibrated),
        "default": agreement(measured, default),
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


def agreement_report(device: ais.Device, profile: DeviceProfile, result: dict[str, Any]) -> str:
    measured: list[Op] = result["device"]
    cal: Agreement = result["calibrated"]
    default: Agreement = result["default"]
    total = max(o.end for o in measured)
    lines = [
        f"the reference workload ({_BATCHES} batches, {len(measured)} operations) on {device} "
        "and on virtual devices",
        f"profile: {profile.describe()}",
        f"  {'':22}{'end to end':>12}{'vs device':>11}  median start error",
        f"  {'device ' + str(device):22}{_ms(total)} ms",
    ]
    for label, a in (("virtual, this profile", cal), ("virtual, default", default)):
        lines.append(
            f"  {label:22}{_ms(a.total)} ms{a.total_error:+11.1%}"
            f"  {a.start_error:.1%} of the op's time"
        )
    verdict = "met" if cal.met() else "MISS"
    lines.append(
        f"goal (this profile): end to end within 5%, median start error within 10%: {verdict}"
    )
    lines.append("per operation, ms from the first event (device | this profile):")
    for d, v in cal.ops:
        lines.append(
            f"  {d.name:10} start {_ms(d.start)} |{_ms(v.start)}  end {_ms(d.end)} |{_ms(v.end)}"
        )
    return "\n".join(lines)


def slug(name: str) -> str:
    out = "".join(c.lower() if c.isalnum() else "-" for c in name)
    return "-".join(part for part in out.split("-") if part) or "device"


def describe(profile: DeviceProfile) -> Iterator[str]:
    """The profile's figures, a line each, with units a person reads."""
    for name in FIGURES:
        figure = profile.figures[name]
        if name.endswith("_bandwidth"):
            text = f"{figure.value / 1e9:.2f} GB/s ± {figure.spread / 1e9:.2f}"
        elif name.endswith("_s"):
            text = f"{figure.value * 1e6:.1f} µs ± {figure.spread * 1e6:.1f}"
        elif name.endswith("_fit_error"):
            text = f"{figure.value:.1%}"
        else:
            text = f"{figure.value:g}"
        yield f"  {name:24} {text}"
