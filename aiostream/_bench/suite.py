"""``python -m aiostream bench``: what aiostream costs on this machine, in about two minutes.

A short selection of the benchmarks under ``benchmarks/``, each against a baseline measured in
the same run, with a progress bar, printed as one table of ratios (or one JSON object). Every
figure is real (wall-clock or CPU) time: the virtual device runs on the monotonic clock here.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import operator
import os
import platform
import statistics
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Protocol, TextIO

import aiostream as ais

from .. import _backends
from . import core, cuda, demo, loader, scale

SECTIONS = ("core", "scale", "loader", "cuda")


@dataclass(frozen=True)
class Row:
    """One measurement: aiostream's figure, the baseline's, and their ratio."""

    section: str
    what: str
    loop: str
    size: str
    ours: float
    baseline: float
    ratio: float
    unit: str
    goal: str


@dataclass(frozen=True)
class Step:
    label: str
    seconds: float  # about how long it takes: the progress bar's weight
    run: Callable[[], list[Row]]


def _versions() -> dict[str, str]:
    out = {"aiostream": ais.__version__, "python": platform.python_version()}
    for dist in ("anyio", "numpy", "uvloop", "trio", "cuda-bindings"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def load_average() -> float | None:
    """The machine's load average over the last minute; None where it does not say."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows; a system that will not tell
        return None


def load_words(cpus: int | None, load: float | None) -> tuple[str, str | None]:
    """The load beside the CPU count (``2 CPUs, load average 3.10``), and, where the load
    exceeds the CPUs, a sentence saying what that does to timings (else None)."""
    where = f"{cpus or '?'} CPUs"
    if load is None:
        return where, None
    where += f", load average {load:.2f}"
    if cpus is None or load <= cpus:
        return where, None
    return where, (
        f"this machine was busy: load average {load:.2f} over its {cpus} CPUs; timings wait "
        "for a CPU there, and may miss goals an idle machine meets"
    )


def machine() -> dict[str, Any]:
    """The machine and what runs on it."""
    ok, reason = _backends.probe("cuda")
    gpus = []
    if ok:
        backend = _backends.get("cuda")
        gpus = [backend.device_name(i) for i in range(ais.device_count("cuda"))]
    return {
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "load": load_average(),
        "versions": _versions(),
        "gpus": gpus,
        "cuda": "available" if ok else f"unavailable: {reason}",
    }


def installed_loops() -> list[str]:
    loops = ["asyncio"]
    for name in ("uvloop", "trio"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        loops.append(name)
    return loops


# ---------------------------------------------------------------------- the steps


def _core(loop: str, quick: bool) -> list[Row]:
    n_fast, rounds = (5_000, 3) if quick else (20_000, 5)
    n_wait = 200 if quick else 1_000
    n_cpu, pending = (200, 0.3) if quick else (1_000, 1.0)
    ours, base = core.run_on(loop, lambda: core.fast_path(n_fast, rounds))
    late = core.run_on(loop, lambda: core.lateness_ours(n_wait, 0.001, 8))
    floor = core.run_on(loop, lambda: core.lateness_base(n_wait, 0.001, loop, rearm=True))
    (cpu, _) = core.run_on(loop, lambda: core.cpu_pending(n_cpu, pending, busy=False))
    (busy, _) = core.run_on(loop, lambda: core.cpu_pending(n_cpu, pending, busy=True))
    med, med_floor = statistics.median(late), statistics.median(floor)
    return [
        Row(
            "core", "await a complete event / a bare checkpoint", loop, f"{n_fast:,} awaits",
            ours * 1e6, base * 1e6, ours / base, "us", "<= 1.5",
        ),
        Row(
            "core", "wake lateness, median / a loop timer", loop, f"{n_wait:,} waits",
            med * 1e6, med_floor * 1e6, med / med_floor, "us", "<= 2",
        ),
        Row(
            "core", "CPU while waits are pending / a query loop", loop, f"{n_cpu:,} waits",
            cpu * 1e3, busy * 1e3, cpu / busy, "ms", "< 0.05",
        ),
    ]  # fmt: skip


def _scale(n: int, quick: bool) -> list[Row]:
    window = 0.3 if quick else scale.MIN_WINDOW
    _, cpu, late = core.run_on("asyncio", lambda: scale.waits_ours(n, window))
    cpu_b, late_b = core.run_on("asyncio", lambda: scale.waits_base(n, window))
    med, med_b = statistics.median(late), statistics.median(late_b)
    return [
        Row(
            "scale", "CPU per wait / a task on a timer", "asyncio", f"{n:,} streams",
            cpu * 1e6, cpu_b * 1e6, cpu / cpu_b, "us", "<= 3",
        ),
        Row(
            "scale", "wake lateness, median / a task on a timer", "asyncio", f"{n:,} streams",
            med * 1e3, med_b * 1e3, med / med_b, "ms", "<= 2 or < 2 ms",
        ),
    ]  # fmt: skip


def _memory(n: int) -> list[Row]:
    ours, base = core.run_on("asyncio", lambda: scale.memory_per_wait(n))
    return [
        Row(
            "scale", "memory per pending wait / a task on a timer", "asyncio", f"{n:,} waits",
            ours, base, ours / base, "B", "< 2 KiB",
        )
    ]  # fmt: skip


def _loader(loop: str, quick: bool) -> list[Row]:
    # 100 batches in --quick too: in fewer, the pipeline's fill and drain weigh on the
    # efficiency (30 batches gave 0.88-0.89 where 100 gave 0.96-0.97)
    cfg = demo.PipelineConfig(batches=100, device=ais.Device("virtual", 0))
    eff, speedup, _, ok, _ = loader.real_time_pipeline(loop, cfg, repeats=1)
    if not ok:
        raise AssertionError("the loader pipeline's checksum did not match")
    return [
        Row(
            "loader", "pipelined batches/s / the bound (slowest stage)", loop,
            f"{cfg.batches} x 1 MiB", eff, 1.0, eff, "", ">= 0.90",
        ),
        Row(
            "loader", "pipelined / sequential, speed-up", loop, f"{cfg.batches} x 1 MiB",
            speedup, 1.0, speedup, "x", ">= 1.8",
        ),
    ]  # fmt: skip


def _cuda(quick: bool) -> list[Row]:
    n, kernel = (100 if quick else 1_000), 20e-6
    strategy = ais.get_wait_strategy()  # what users' waits get: quiet unless chosen
    lat, _ = cuda.short_awaits(n, kernel, cuda.strategy_wait(strategy))
    floor, _ = cuda.floor_thread(n, kernel)
    med, med_f = statistics.median(lat), statistics.median(floor)
    waits, streams = (100, 10) if quick else (1_000, 100)
    run = cuda.scale(waits, streams, "asyncio", strategy, window=0.3 if quick else 0.5)
    pending = cuda.pending_cpu(waits, streams, 0.3 if quick else 1.0, strategy)
    size = f"{waits:,} waits, {streams} streams"
    return [
        Row(
            "cuda", "await of a 20 us kernel, latency / cuEventSynchronize", "asyncio",
            f"{n:,} awaits", med * 1e6, med_f * 1e6, med / med_f, "us", "<= 3",
        ),
        Row(
            "cuda", "wake lateness, median / a loop timer", "asyncio", size,
            run.late_median_us, run.timer_late_median_us,
            run.late_median_us / max(run.timer_late_median_us, 1e-9), "us", "-",
        ),
        Row(
            "cuda", "aiostream threads at the peak / the bound", "asyncio", size,
            run.ours_peak, 2, run.ours_peak / 2, "", "<= 1",
        ),
        Row(
            "cuda", "CPU while waits pend, % of a core / the bound", "asyncio", size,
            pending * 100, 1.0, pending * 100, "%", "< 1",
        ),
    ]  # fmt: skip


def steps(loops: list[str], sections: list[str], quick: bool) -> list[Step]:
    """What to run, in order, each with the seconds it is expected to take (as measured on a
    2-core machine: a step's share of the bar is its share of the run's time)."""
    out: list[Step] = []
    if "core" in sections:
        for loop in loops:
            out.append(Step(f"core ({loop})", 1.5 if quick else 6, partial(_core, loop, quick)))
    if "scale" in sections:
        sizes = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
        window = 0.3 if quick else scale.MIN_WINDOW  # as _scale runs it
        for n in sizes:
            # each side waits out its lead and window; making the streams adds a little
            cost = 2 * (scale.lead(n, window) + scale.window(n, window)) + n * 2e-5
            out.append(Step(f"scale ({n:,} streams)", cost, partial(_scale, n, quick)))
        mem = max(sizes)
        out.append(Step(f"memory ({mem:,} waits)", mem * 2.4e-4, partial(_memory, mem)))
    if "loader" in sections:
        for loop in loops:
            out.append(Step(f"loader ({loop})", 1.5, partial(_loader, loop, quick)))
    if "cuda" in sections and _backends.probe("cuda")[0]:
        out.append(Step("cuda (cuda:0)", 5 if quick else 15, partial(_cuda, quick)))
    return out


# ---------------------------------------------------------------------- running and printing


class Weighted(Protocol):
    """What the progress bar reads of a step."""

    @property
    def label(self) -> str: ...
    @property
    def seconds(self) -> float: ...


class Progress:
    """A text progress bar weighted by the steps' expected seconds: redrawn in place on a
    terminal, a line per step otherwise. On a terminal it also moves while a step runs (a
    step takes up to a minute): every ``TICK`` seconds, by the step's time so far, up to
    ``AHEAD`` of its expected seconds."""

    TICK = 0.5
    AHEAD = 0.95

    def __init__(self, todo: Sequence[Weighted], out: TextIO) -> None:
        self.todo, self.out, self.live = todo, out, out.isatty()
        self.total = sum(s.seconds for s in todo) or 1.0
        self.done = 0.0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def running(self, index: int) -> Iterator[None]:
        """Around step ``index``: its line, then (on a terminal) the bar moving meanwhile."""
        self.show(index)
        if not self.live:
            yield
            self.step_done(index)
            return
        stop = threading.Event()
        began = time.perf_counter()
        expected = self.todo[index].seconds

        def tick() -> None:
            while not stop.wait(self.TICK):
                self.show(index, min(time.perf_counter() - began, self.AHEAD * expected))

        # not named "aiostream ...": the cuda step counts those threads as aiostream's own
        ticker = threading.Thread(target=tick, name="bench progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
        self.step_done(index)

    def show(self, index: int, within: float = 0.0) -> None:
        width = 30
        filled = round(width * (self.done + within) / self.total)
        label = self.todo[index].label if index < len(self.todo) else "done"
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {index}/{len(self.todo)} steps, "
            f"{time.perf_counter() - self.started:4.0f} s: {label}"
        )
        self.out.write(demo.redraw(line) if self.live else line + "\n")
        if self.live and index == len(self.todo):
            self.out.write("\n")
        self.out.flush()

    def step_done(self, index: int) -> None:
        self.done += self.todo[index].seconds


def run(
    loops: list[str], sections: list[str], quick: bool, progress: TextIO | None = None
) -> dict[str, Any]:
    """Run the steps; the machine, the rows and how long it took."""
    todo = steps(loops, sections, quick)
    bar = Progress(todo, progress if progress is not None else sys.stderr)
    rows: list[Row] = []
    started = time.perf_counter()
    for i, step in enumerate(todo):
        with bar.running(i):
            rows.extend(step.run())
    bar.show(len(todo))
    cuda_ok, why = _backends.probe("cuda")
    return {
        "machine": machine(),
        "quick": quick,
        "seconds": time.perf_counter() - started,
        "clock": "real time (the virtual device on the monotonic clock; CPU time where named)",
        "rows": [asdict(r) for r in rows],
        "skipped": [] if cuda_ok or "cuda" not in sections else [f"cuda: {why}"],
    }


def _figure(value: float, unit: str) -> str:
    if unit in ("", "x"):
        return f"{value:.2f}{unit}"
    return f"{value:,.1f} {unit}" if abs(value) < 1000 else f"{value:,.0f} {unit}"


def _ratio(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
#: a goal's unit, in the row's unit: "< 2 KiB" of a row in bytes
_UNITS = {"KiB": ("B", 1024.0), "ms": ("ms", 1.0), "us": ("us", 1.0)}


def met(row: dict[str, Any]) -> bool | None:
    """Whether a row meets its goal; None where it has none ("-").

    A goal is one or more alternatives joined by "or": ``OP NUMBER`` compares the ratio,
    ``OP NUMBER UNIT`` compares aiostream's own figure (``"<= 2 or < 2 ms"``: within twice
    the baseline, or under 2 ms whatever the baseline).
    """
    goal = row["goal"].strip()
    if goal in ("", "-"):
        return None
    for alternative in goal.split(" or "):
        op, number, *unit = alternative.split()
        value = row["ratio"]
        limit = float(number)
        if unit:
            (name,) = unit
            want, scale = _UNITS[name]
            if row["unit"] != want:
                raise ValueError(f"goal {goal!r} is in {name}, the row in {row['unit']!r}")
            value, limit = row["ours"], limit * scale
        if _COMPARE[op](value, limit):
            return True
    return False


def missed(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows that miss their goals."""
    return [r for r in report["rows"] if met(r) is False]


def table(report: dict[str, Any], width: int = 80) -> str:
    """The report as text that fits ``width`` columns (at least 80): per row, the measure on
    one line and the figures under it (77 columns), each row marked ``ok`` or ``MISS``
    against its goal."""
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    cpus, busy = load_words(m["cpus"], m.get("load"))
    head = (
        f"aiostream bench{' (quick)' if report['quick'] else ''}: {m['platform']}, "
        f"{cpus}; {versions}"
    )
    lines = textwrap.wrap(head, width, subsequent_indent="  ", break_on_hyphens=False)
    lines += [
        *textwrap.wrap(
            f"GPUs: {', '.join(m['gpus']) or 'none'} (CUDA {m['cuda'].split(':')[0]})",
            width,
            subsequent_indent="  ",
        ),
        *textwrap.wrap(f"{report['clock']}; {report['seconds']:.0f} s in all", width),
        "",
        "measure (aiostream / baseline)",
        f"  {'loop':8} {'size':15} {'aiostream':>10} {'baseline':>10} {'ratio':>7}  "
        f"{'goal':14} met",
    ]
    for r in report["rows"]:
        verdict = {None: "", True: "ok", False: "MISS"}[met(r)]
        size = r["size"]
        measure = f"{r['section']}: {r['what']}"
        if len(size) > 15:  # its column's width: said with the measure instead
            measure, size = f"{measure} ({size})", ""
        lines.append(measure[:width])
        lines.append(
            f"  {r['loop']:8} {size:15} {_figure(r['ours'], r['unit']):>10} "
            f"{_figure(r['baseline'], r['unit']):>10} {_ratio(r['ratio']):>7}  "
            f"{r['goal']:14} {verdict}".rstrip()
        )
    for why in report["skipped"]:
        lines += textwrap.wrap(f"not run: {why}", width, subsequent_indent="  ")
    misses = missed(report)
    lines.append("")
    lines.append(
        f"{len(misses)} of {sum(met(r) is not None for r in report['rows'])} goals missed"
        if misses
        else "every goal met"
    )
    if busy is not None:
        lines += textwrap.wrap(busy, width)
    return "\n".join(lines)
