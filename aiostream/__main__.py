"""The command line: ``python -m aiostream info``, ``demo``, ``streams``, ``bench`` and
``calibrate``.

Each command is a function (``COMMANDS``) beside the helpers only it uses; every command's
arguments are declared together (``_parser``), and ``main`` parses them and runs the command.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import anyio

import aiostream as ais

from . import _backends, _distribution
from ._bench import demo, suite
from ._bench.demo import streams_demo

# ------------------------------------------------------------------ shared by the commands
# The terminal, how the user ran the CLI, and the checks of more than one command.


LOOPS = ("asyncio", "uvloop", "trio")


def _fit(text: str) -> str:
    """``text`` with each line longer than the terminal wrapped at spaces, its continuation
    indented two more than the line (a word longer than a line stays whole)."""
    width = demo.columns()
    out: list[str] = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        lead = " " * (len(line) - len(line.lstrip()))
        out += textwrap.wrap(
            line,
            width,
            subsequent_indent=lead + "  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(out)


def _prog() -> str:
    """How the user ran the CLI: the ``aiostream`` console script, or ``python -m``."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "aiostream" if name in ("aiostream", "aiostream.exe") else "python -m aiostream"


def _failed(command: str, message: str) -> int:
    """A run that failed after its checks passed: one line on stderr, exit status 1."""
    print(_fit(f"{_prog()} {command}: error: {message}"), file=sys.stderr)
    return 1


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device(parser: argparse.ArgumentParser, spec: str | None) -> ais.Device:
    """The device ``--device`` names, else ``$AIOSTREAM_DEVICE``, else the default device; an
    error names where the spec came from. A virtual device past the simulator's count is made,
    whichever names it: the CLI's simulator has as many devices as the command asks for."""
    label = f"--device {spec}: " if spec is not None else ""  # the default's error says why
    if spec is None and os.environ.get("AIOSTREAM_DEVICE"):
        spec = os.environ["AIOSTREAM_DEVICE"]
        label = f"AIOSTREAM_DEVICE={spec}: "
    try:
        if spec is not None and spec.strip().startswith("virtual:"):
            index = spec.strip().partition(":")[2]
            if index.isascii() and index.isdigit() and int(index) >= ais.device_count("virtual"):
                ais.virtual.reset(devices=int(index) + 1)
        return ais.device(spec)
    except (ValueError, TypeError, ais.AiostreamError) as exc:
        parser.error(f"{label}{exc}")


def _device_and_loop(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ais.Device:
    """The device ``demo`` and ``streams`` run on, once their ``--loop`` is installed."""
    device = _device(parser, args.device)
    if args.loop != "asyncio" and _dist_version(args.loop) is None:
        parser.error(
            f"--loop {args.loop} needs the {args.loop!r} package: pip install {args.loop} "
            f'(or, from aiostream\'s checkout, python -m pip install ".[{args.loop}]")'
        )
    return device


def _run(main: object, loop: str) -> None:
    """Run the async function ``main`` on ``loop``: asyncio, uvloop or trio."""
    if loop == "trio":
        anyio.run(main, backend="trio")  # type: ignore[arg-type]
    else:
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})  # type: ignore[arg-type]


def _check_writable(parser: argparse.ArgumentParser, flag: str, path: str) -> None:
    """Refuse a file this run could not write, before any work: the path is opened for
    appending (a file already there keeps its bytes; one made here is removed again)."""
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        parser.error(f"{flag} {path}: names a folder; name a file (in it)")
    existed = os.path.lexists(path)
    # not blocking: a FIFO with no reader is refused rather than waited on
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0)
    try:
        os.close(os.open(path, flags, 0o666))
    except OSError as exc:
        folder = os.path.dirname(path) or os.curdir
        if not os.path.isdir(folder):
            parser.error(f"{flag} {path}: {folder} is not a folder this user can write in")
        parser.error(f"{flag} {path}: cannot write it: {exc.strerror or exc}")
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(path)


# ------------------------------------------------------------------ info


def _info_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    print(_fit(info()))
    return 0


def info() -> str:
    """What this machine offers aiostream: versions, loops, backends and devices."""
    lines = [f"aiostream {ais.__version__} (Python {platform.python_version()})"]
    # cuda-bindings: the package the CUDA backend imports (cuda-python's metapackage brings
    # it; images with PyTorch or CuPy may have it alone)
    for dist in ("anyio", "cuda-bindings"):
        lines.append(f"  {dist}: {_dist_version(dist) or 'not installed'}")
    loops = ["asyncio (built in)"]
    for name in ("uvloop", "trio"):
        v = _dist_version(name)
        loops.append(f"{name} {v}" if v else f"{name} (not installed)")
    lines.append("loops: " + ", ".join(loops))
    lines.append("backends:")
    for kind in ("virtual", "cuda"):
        try:
            ok, reason = _backends.probe(kind)
        except ValueError as exc:  # the virtual backend's options: AIOSTREAM_VIRTUAL_PROFILE
            ok, reason = False, str(exc)
        if ok:
            n = ais.device_count(kind)
            backend = _backends.get(kind)
            names = ", ".join(f"{kind}:{i} ({backend.device_name(i)})" for i in range(n))
            lines.append(f"  {kind:8} available, {n} device{'s' if n != 1 else ''}: {names}")
        else:
            lines.append(f"  {kind:8} unavailable: {reason}")
    try:
        lines.append(f"default device: {ais.device()}")
    except (ValueError, ais.AiostreamError) as exc:
        lines.append(f"default device: none ({exc})")
    other = _distribution.other_distribution()
    if other is not None:
        lines.append(f"CONFLICT: {_distribution.advice(other)}")
    return "\n".join(lines)


# ------------------------------------------------------------------ demo


def _demo_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    for flag, path in (("--trace", args.trace), ("--svg", args.svg)):
        if path is not None:
            _check_writable(parser, flag, path)
    device = _device_and_loop(parser, args)
    if args.prefetch is not None and args.prefetch < args.workers:
        parser.error(
            f"--prefetch {args.prefetch} must be >= --workers {args.workers}: each worker "
            "transforms an item ahead of the consumer"
        )
    prefetch = _demo_prefetch(args, device)
    _check_demo_memory(parser, args, prefetch)
    return _run_demo(args, device, prefetch)


def _demo_prefetch(args: argparse.Namespace, device: ais.Device) -> int:
    """The demo loader's prefetch: ``--prefetch``, else the loader's own default."""
    return ais.DataLoader((), prefetch=args.prefetch, workers=args.workers, device=device).prefetch


#: the memory the demo's buffers may take where the machine does not say how much it has
DEMO_MEMORY_UNKNOWN = 4 << 30


def _check_demo_memory(
    parser: argparse.ArgumentParser, args: argparse.Namespace, prefetch: int
) -> None:
    """Refuse a demo whose batch-sized buffers would take more than half of this machine's
    memory (each counted as host memory, where a virtual device keeps its own), or more than
    ``DEMO_MEMORY_UNKNOWN`` where the machine does not say how much it has."""
    count = demo.batch_buffers(prefetch, args.workers)
    held = count * args.batch_kb * 1024
    memory = _physical_memory()
    bound = DEMO_MEMORY_UNKNOWN if memory is None else memory // 2
    if held > bound:
        whose = (
            f"half of this machine's {memory / 2**30:.1f} GiB"
            if memory is not None
            else f"{bound / 2**30:.0f} GiB (this machine does not say how much it has)"
        )
        parser.error(
            f"--batch-kb {args.batch_kb} with --prefetch {prefetch} and --workers "
            f"{args.workers}: the demo would hold up to {count} buffers of {args.batch_kb} KiB "
            f"({held / 2**30:.1f} GiB), more than {whose}: lower --batch-kb, --prefetch or "
            "--workers"
        )


def _physical_memory() -> int | None:
    """Bytes of memory this machine has; None where it does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


#: the name of the demo's pipelined run's task: its track in the trace
DEMO_TASK = "pipelined run"


def _run_demo(args: argparse.Namespace, device: ais.Device, prefetch: int) -> int:
    cfg = demo.PipelineConfig(
        batches=args.batches,
        nbytes=args.batch_kb * 1024,
        host_s=args.host_ms / 1000,
        compute_s=args.compute_ms / 1000,
        prefetch=args.prefetch,
        workers=args.workers,
        device=device,
    )
    print(
        _fit(
            f"aiostream demo on {device}, {args.loop} loop: {cfg.batches} batches of "
            f"{args.batch_kb} KiB, host {args.host_ms:g} ms, compute {args.compute_ms:g} ms, "
            f"prefetch {prefetch}, workers {cfg.workers}"
        )
    )
    live = sys.stderr.isatty()

    def to_stderr(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    bar = demo.progress_bar(cfg.batches, to_stderr, live=live)
    results: dict[str, demo.PipelineResult] = {}

    tracing = args.trace is not None or args.svg is not None

    async def pipelined() -> None:
        results["pipe"] = await demo.run_pipeline(cfg, progress=bar)

    async def run() -> None:
        with ais.profile(device) if tracing else contextlib.nullcontext() as prof:
            # a task of its own, named for the trace's track of it (anyio would name it by
            # its function: _run_demo.<locals>.pipelined)
            async with anyio.create_task_group() as tg:
                tg.start_soon(pipelined, name=DEMO_TASK)
        if prof is not None:
            profiles.append(prof)
        if live:
            sys.stderr.write("\n")
        results["seq"] = await demo.run_sequential(cfg)

    profiles: list[ais.Profiler] = []
    try:
        _run(run, args.loop)
    except Exception as exc:
        failure = _out_of_memory(exc)
        if failure is None:
            raise
        if live:
            sys.stderr.write("\n")
        count = demo.batch_buffers(prefetch, args.workers)
        return _failed(
            "demo",
            f"{str(failure) or type(failure).__name__} (the demo holds up to {count} buffers "
            f"of {args.batch_kb} KiB: lower --batch-kb, --prefetch or --workers)",
        )
    print(_fit(_pipeline_report(results["seq"], results["pipe"])))
    if profiles:
        print("\nprofile of the pipelined run:")
        print(_fit(str(profiles[0].summary())))
        for flag, kind, path, export in (
            (
                "--trace",
                "trace (open in https://ui.perfetto.dev or chrome://tracing)",
                args.trace,
                profiles[0].export_chrome_trace,
            ),
            ("--svg", "timeline picture", args.svg, profiles[0].export_svg),
        ):
            if path is None:
                continue
            try:
                export(path)
            except OSError as exc:
                return _failed("demo", f"{flag} {path}: cannot write it: {exc.strerror or exc}")
            print(_fit(f"wrote the {kind}: {path}"))
    return 0 if results["pipe"].checksum_ok and results["seq"].checksum_ok else 1


def _out_of_memory(exc: BaseException) -> BaseException | None:
    """The MemoryError, or the DeviceError refusing memory, that ``exc`` is or holds (an
    exception group's, from the loader's tasks); None where there is none."""
    if isinstance(exc, MemoryError) or (isinstance(exc, ais.DeviceError) and "memory" in str(exc)):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _out_of_memory(inner)
        if found is not None:
            return found
    return None


def _pipeline_report(seq: demo.PipelineResult, pipe: demo.PipelineResult) -> str:
    def stage(name: str, sec: float) -> str:
        text = f"{name} {sec * 1000:.2f} ms"
        if name == "host" and seq.workers > 1:
            text += f" ({seq.per_batch_s[name] * 1000:.2f} ms per batch with {seq.workers} workers)"
        return text

    stages = ", ".join(stage(name, sec) for name, sec in seq.stage_s.items())
    # a busy machine's timings miss the bound by its load, not aiostream's cost: said
    cpus, busy = suite.load_words(os.cpu_count(), suite.load_average())
    slowest, per_batch = demo.bound(seq, pipe)
    ideal = seq.batches * per_batch
    ok = {True: "checksum ok", False: "CHECKSUM MISMATCH"}
    return "\n".join(
        [
            f"pipelined:  {pipe.batches} batches in {pipe.seconds:.3f} s = "
            f"{pipe.batches_per_s:7.1f} batches/s ({ok[pipe.checksum_ok]})",
            f"sequential: {seq.batches} batches in {seq.seconds:.3f} s = "
            f"{seq.batches_per_s:7.1f} batches/s ({ok[seq.checksum_ok]})",
            f"stages per item (measured in the sequential run): {stages}",
            f"event loop CPU per batch (pipelined run): {pipe.loop_cpu_s * 1000:.2f} ms",
            f"bottleneck: {slowest}, {per_batch * 1000:.2f} ms per batch",
            f"efficiency against the bound: {ideal / pipe.seconds:.2f} (ideal {ideal:.3f} s = "
            f"{seq.batches} batches x {per_batch * 1000:.2f} ms, over the measured "
            f"{pipe.seconds:.3f} s)",
            f"speed-up over sequential: {seq.seconds / pipe.seconds:.2f}x",
            f"buffers: at most {pipe.peak_in_use} of the loader's {pipe.pool_size} slots in use",
            f"machine: {cpus}",
            *([busy] if busy is not None else []),
        ]
    )


# ------------------------------------------------------------------ streams


#: the most seconds of device work ``streams`` runs (it runs them in real time)
STREAMS_MOST_S = 600.0


def _streams_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    device = _device_and_loop(parser, args)
    # task i has (tasks - i) units of work, and a virtual device runs them one after another
    work_s = args.duration_ms * args.tasks * (args.tasks + 1) / 2 / 1000
    if work_s > STREAMS_MOST_S:
        parser.error(
            f"--tasks {args.tasks} with --duration-ms {args.duration_ms:g}: the device work "
            f"would take up to {_duration(work_s)} (duration x tasks x (tasks + 1) / 2); at "
            f"most {STREAMS_MOST_S:.0f} s: lower --tasks or --duration-ms"
        )
    out: list[str] = []
    print(_fit(f"aiostream streams demo on {device}, {args.tasks} tasks, {args.loop} loop"))

    async def run() -> None:
        await streams_demo(device, args.tasks, args.duration_ms, out)

    _run(run, args.loop)
    print(_fit("\n".join(out)))
    return 0


def _duration(seconds: float) -> str:
    """``seconds`` as a person reads it: seconds, with hours or days where it runs that long."""
    text = f"{seconds:,.0f} s"
    if seconds >= 86_400:
        return f"{text} ({seconds / 86_400:,.0f} days)"
    if seconds >= 3_600:
        return f"{text} ({seconds / 3_600:.1f} hours)"
    return text


# ------------------------------------------------------------------ bench


def _bench_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    installed = suite.installed_loops()
    loops = _names(
        parser, "--loops", ",".join(installed) if args.loops is None else args.loops, LOOPS
    )
    for loop in loops:
        if loop not in installed:
            parser.error(f"--loops {loop} needs the {loop!r} package: pip install {loop}")
    sections = _names(parser, "--sections", args.sections, suite.SECTIONS)
    report = suite.run(loops, sections, args.quick)
    print(
        json.dumps(report) if args.json else suite.table(report, max(80, min(100, demo.columns())))
    )
    return 1 if suite.missed(report) else 0


def _names(
    parser: argparse.ArgumentParser, flag: str, text: str, known: Sequence[str]
) -> list[str]:
    """A comma-separated list of names, each one of ``known``."""
    names = text.split(",")
    for name in names:
        if name not in known:
            parser.error(f"{flag}: {name!r} is not one of {', '.join(known)}")
    return names


# ------------------------------------------------------------------ calibrate


def _calibrate_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._bench import calibrate  # numpy and virtual time: only for this command

    if not args.device.strip().startswith("cuda"):
        parser.error(
            f"--device {args.device}: calibrate measures a CUDA device; a virtual device's "
            "figures are the ones it was given"
        )
    if args.out is not None:
        _check_writable(parser, "--out", args.out)
    ok, why = _backends.probe("cuda")
    if not ok:  # without the backend's advice to use a virtual device, refused above
        parser.error(f"no CUDA device to measure: {why.replace(_USE_VIRTUAL, '')}")
    device = _device(parser, args.device)
    plan = calibrate.QUICK if args.quick else calibrate.FULL
    if args.check is not None:
        try:
            profile = ais.virtual.DeviceProfile.load(args.check)
        except (OSError, ValueError) as exc:
            parser.error(f"--check {args.check}: {exc}")
        result = calibrate.check(device, profile, plan)
        print(_fit(calibrate.agreement_report(device, profile, result)))
        return 0 if result["calibrated"].met() else 1
    backend = _backends.get("cuda")
    out = Path(args.out or f"aiostream-{calibrate.slug(backend.device_name(device.index))}.json")
    if args.out is None:
        _check_writable(parser, "--out", str(out))
    profile = calibrate.calibrate(device, plan, sys.stderr)
    try:
        profile.dump(out)
    except OSError as exc:
        return _failed("calibrate", f"--out {out}: cannot write it: {exc.strerror or exc}")
    print(_fit(f"{profile.describe()}: written to {out}"))
    print("\n".join(calibrate.describe(profile)))
    print(
        _fit(
            f"use it: aiostream.virtual.reset(profile={str(out)!r}); check it: {_prog()} "
            f"calibrate --check {out}"
        )
    )
    return 0


#: the end of the CUDA backend's reasons it is unavailable (_backends/cuda/driver.py), advice
#: that calibrate leaves out
_USE_VIRTUAL = ", or use a virtual device ('virtual:0')"


# ------------------------------------------------------------------ the arguments
# Every command's arguments, declared here and nowhere else.


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser, and each command's own (its ``error()`` names it)."""
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="aiostream's command line: what this machine has, and demos to run on it.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"aiostream {ais.__version__} (distribution aiostream-cuda)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "info": _info_arguments(sub),
        "demo": _demo_arguments(sub),
        "streams": _streams_arguments(sub),
        "bench": _bench_arguments(sub),
        "calibrate": _calibrate_arguments(sub),
    }
    return parser, commands


def _info_arguments(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    return sub.add_parser(
        "info",
        help="backends, devices and versions on this machine",
        description="The backends, devices and versions on this machine.",
    )


def _demo_arguments(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "demo",
        help="the end-to-end pipeline: host transform, copies, compute, results checked",
        description=(
            "The end-to-end data pipeline on one device: a host transform, host-to-device "
            "copies, compute, device-to-host copies, the results checked against the host; "
            "then the same work sequentially. Exit status 0 when both runs' results check out, "
            "1 when they do not or the run fails (out of memory, a file it cannot write), 2 on "
            "a usage error."
        ),
    )
    parser.add_argument(
        "--device",
        default=None,
        help="device, e.g. virtual:0 or cuda:1 (default: $AIOSTREAM_DEVICE, else cuda:0 where "
        "CUDA works, else virtual:0)",
    )
    parser.add_argument(
        "--batches",
        type=_positive(int, "--batches", 1_000_000),
        default=100,
        help="batches to run (default 100)",
    )
    parser.add_argument(
        "--batch-kb",
        type=_positive(int, "--batch-kb", 1 << 16),
        default=1024,
        help="KiB per batch (default 1024, at most 65536; the buffers of every batch in "
        "flight must fit in half of this machine's memory)",
    )
    parser.add_argument(
        "--host-ms",
        type=_positive(float, "--host-ms", 60_000),
        default=2.0,
        help="host transform per batch, ms (default 2)",
    )
    parser.add_argument(
        "--compute-ms",
        type=_positive(float, "--compute-ms", 60_000),
        default=3.0,
        help="device compute per batch, ms (default 3)",
    )
    parser.add_argument(
        "--prefetch",
        type=_positive(int, "--prefetch", 1024),
        default=None,
        help="items the loader works on ahead (default: 2 x workers)",
    )
    parser.add_argument(
        "--workers",
        type=_positive(int, "--workers", 256),
        default=2,
        help="host transforms at once (default 2)",
    )
    parser.add_argument(
        "--loop", choices=LOOPS, default="asyncio", help="event loop (default asyncio)"
    )
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace (JSON)")
    parser.add_argument("--svg", metavar="PATH", help="draw the timeline as an SVG picture")
    return parser


def _streams_arguments(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "streams",
        help="tasks awaiting device work on their own streams",
        description=(
            "Tasks that each record work on their own stream and await it; prints when each "
            "resumes and the device timeline."
        ),
    )
    parser.add_argument(
        "--device", default=None, help="device, e.g. virtual:0 (default: as for demo)"
    )
    parser.add_argument(
        "--tasks",
        type=_positive(int, "--tasks", 10_000),
        default=4,
        help="tasks (default 4); task i has tasks - i units of work, and the run takes their sum "
        f"(at most {STREAMS_MOST_S:.0f} s)",
    )
    parser.add_argument(
        "--duration-ms",
        type=_positive(float, "--duration-ms", 60_000),
        default=40.0,
        help="work per task unit, ms (default 40)",
    )
    parser.add_argument(
        "--loop", choices=LOOPS, default="asyncio", help="event loop (default asyncio)"
    )
    return parser


def _bench_arguments(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "bench",
        help="what aiostream costs on this machine: one table of ratios, in about two minutes",
        description=(
            "Run a short selection of the benchmarks (the waiter's costs, waits at scale up to "
            "100,000 streams, the data loader, and CUDA waits where a GPU works), each against "
            "a baseline measured in the same run, and print one table of ratios with the "
            "machine and versions. All figures are real time. benchmarks/ in the source tree "
            "has the full scripts. Exit status: 0 when every row with a goal meets it, 1 when "
            "one misses it (marked MISS in the table), 2 on a usage error."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes: about 20 s")
    parser.add_argument(
        "--loops",
        default=None,
        help="comma-separated loops (default: every installed one of asyncio, uvloop, trio)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(suite.SECTIONS),
        help=f"comma-separated sections (default: {','.join(suite.SECTIONS)})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    return parser


def _calibrate_arguments(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "calibrate",
        help="measure a CUDA device and write a profile a virtual device can take",
        description=(
            "Measure a CUDA device (copies each way from pinned and pageable memory, 4 KiB to "
            "256 MiB; kernel launch overhead; how many kernels and copies run at once; a "
            "waiter's wake-up) and write a profile (JSON): aiostream.virtual.reset(profile="
            "FILE) then makes virtual devices that take their time model from it. Under a "
            "minute; --quick, seconds. With --check FILE, run one reference workload on the "
            "device and on virtual devices (the profile's and the default) and print how far "
            "apart they are; exit status 1 when the profile misses the goal (end to end within "
            "5%, median start error within 10% of each operation's time). Exit status 2 on "
            "a usage error, a bad profile, or no CUDA device."
        ),
    )
    parser.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    parser.add_argument(
        "--out", metavar="FILE", help="where to write the profile (default: aiostream-<gpu>.json)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats: seconds")
    parser.add_argument(
        "--check", metavar="FILE", help="compare this profile's virtual device with the device"
    )
    return parser


def _positive(kind: type, name: str, most: float):  # type: ignore[no-untyped-def]
    """An argparse type: a ``kind`` above 0 and at most ``most`` (a bound past any demo's need,
    that keeps a typo from hanging the run or allocating everything up front), written in
    ASCII (``int`` and ``float`` alone also take other scripts' digits, as device indexes do
    not)."""

    def parse(text: str):  # type: ignore[no-untyped-def]
        try:
            if not text.isascii():
                raise ValueError(text)
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        if not value <= most:  # NaN too
            raise argparse.ArgumentTypeError(f"{name} must be at most {most:.15g}, got {text}")
        return value

    return parse


# ------------------------------------------------------------------ running a command
# Each command's function takes its own parser (whose error() exits with status 2 and a
# usage line) and the parsed arguments, checks what argparse cannot before any work, and
# returns the exit status.


#: each command's function, by its name on the command line
COMMANDS = {
    "info": _info_command,
    "demo": _demo_command,
    "streams": _streams_command,
    "bench": _bench_command,
    "calibrate": _calibrate_command,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    shadowed = _distribution.shadowed(ais)
    if shadowed is not None:  # another project's aiostream/__init__.py: say so, not a traceback
        print(_fit(f"python -m aiostream: {shadowed}"), file=sys.stderr)
        return 1
    parser, commands = _parser()
    args = parser.parse_args(argv)
    command = commands[args.command]
    if args.command != "info":
        try:  # every other command waits: AIOSTREAM_WAIT_STRATEGY, read now rather than at a wait
            ais.get_wait_strategy()
        except ValueError as exc:
            command.error(str(exc))
    return COMMANDS[args.command](command, args)


if __name__ == "__main__":
    sys.exit(main())
