"""What aiostream's telemetry hooks cost: nothing when off, at most 2x a wait when tracing.

1. Off: no listener plugged in. Two figures, in this checkout against a baseline revision
   (default ``68ba744``, the last commit before the hooks), each in child processes run
   alternately (``git worktree`` checks the baseline out in a temporary folder): an await of
   complete work (seconds per await, over N awaits, the best of 5 passes), and a pending
   wait's CPU (process CPU seconds per wait for N tasks awaiting work held until all of them
   wait, the best of 3 passes, 1 at 100,000); the median over the rounds. Goal: within 3%.
2. On: the same figures in one process with ``aiostream.tracing`` on (the OpenTelemetry SDK,
   a span processor whose exporter does nothing) and with ``aiostream.metrics`` on, against
   off. Goal: tracing costs a wait at most 2x.

Sizes: N = 1,000, 10,000 and 100,000 (``--quick``: 1,000 and 10,000); each row prints its
ratio, so the cost per wait is seen to stay flat as N grows. Real time on the virtual
backend; asyncio's loop. The exit status is 0 either way (a shared machine misses goals).

3. ``--instructions``: part 1's figures as instructions, which load does not change: each
   tree's child runs N waits once under valgrind (``cachegrind``, no cache simulation; a fixed
   hash seed), for N = 1,000, 5,000 and 25,000; the instructions per wait are the difference
   between two sizes over the difference of their N (start-up and imports cancel), so each
   row is the cost of one more wait at that scale. Needs valgrind; a few minutes.

Usage: python benchmarks/bench_telemetry.py [--quick] [--baseline REV] [--rounds R]
       python benchmarks/bench_telemetry.py --instructions [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "68ba744"


# ---------------------------------------------------------------------- the measurements


def measure(kind: str, n: int, mode: str, passes: int | None = None) -> float:
    """Seconds per await (``fast``) or CPU seconds per wait (``pending``), with ``mode``'s
    telemetry (``off``, ``tracing``, ``metrics``): the best of ``passes`` (default 5 for
    ``fast``, 3 for ``pending``, 1 at 100,000). Part 3 runs it with one pass: its count
    of instructions per wait is a difference between sizes, which the warm-up cancels."""
    import anyio

    import aiostream as ais

    if passes is None:
        passes = 5 if kind == "fast" else (3 if n <= 10_000 else 1)

    with _telemetry(mode):

        async def fast() -> float:
            e = ais.Stream("virtual:0").record_event()
            for _ in range(1000):  # warm
                await e.synchronize()
            best = math.inf
            for _ in range(passes):  # the least disturbed pass
                t = time.perf_counter()
                for _ in range(n):
                    await e.synchronize()
                best = min(best, (time.perf_counter() - t) / n)
            return best

        async def pending() -> float:
            best = math.inf
            for _ in range(passes):  # the least disturbed pass
                s = ais.Stream("virtual:0")
                held = ais.virtual.stall("compute")  # pending until every task waits
                ais.delay(0.001, stream=s)
                events = [s.record_event() for _ in range(n)]
                t = time.process_time()
                async with anyio.create_task_group() as tg:
                    for e in events:
                        tg.start_soon(e.synchronize)
                    while ais.virtual.stats().waits < n:  # O(1): not a listing of n
                        await anyio.sleep(0.01)
                    held.release()
                best = min(best, (time.process_time() - t) / n)
            return best

        return anyio.run(fast if kind == "fast" else pending)


@contextlib.contextmanager
def _telemetry(mode: str) -> Iterator[None]:
    if mode == "off":
        yield
        return
    if mode == "metrics":
        import prometheus_client

        import aiostream.metrics

        with aiostream.metrics.PrometheusMetrics(prometheus_client.CollectorRegistry()):
            yield
        return
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    import aiostream.tracing

    class Nothing(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Nothing()))
    with aiostream.tracing.instrument(provider):
        yield


# ---------------------------------------------------------------------- off: against a baseline


def _child_env(tree: Path, **extra: str) -> dict[str, str]:
    """The environment of a child that imports aiostream from ``tree``."""
    return {**os.environ, "PYTHONPATH": str(tree), "AIOSTREAM_DEVICE": "virtual", **extra}


def child(tree: Path, kind: str, n: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(n)],
        capture_output=True,
        text=True,
        env=_child_env(tree),
        cwd=tree,
        check=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def instructions(tree: Path, kind: str, n: int) -> int:
    """The instructions a child running one pass of ``measure(kind, n, "off")`` in ``tree``
    executes, start-up included, as valgrind's cachegrind counts them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                "valgrind",
                "--tool=cachegrind",
                "--cache-sim=no",
                f"--cachegrind-out-file={tmp}/out",
                sys.executable,
                __file__,
                "--once",
                kind,
                str(n),
            ],
            capture_output=True,
            text=True,
            env=_child_env(tree, PYTHONHASHSEED="0"),
            cwd=tree,
            check=True,
        )
    found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def instruction_rows(baseline: str) -> None:
    """Part 3: instructions per wait, this checkout against the baseline."""
    if shutil.which("valgrind") is None:
        print("skipped: valgrind is not installed (Debian: apt install valgrind)")
        return
    sizes = (1_000, 5_000, 25_000)
    print(f"3. telemetry off, instructions per wait (valgrind): this checkout against {baseline}")
    print(f"{'':34} {'N':>15} {'ours':>9} {'baseline':>9} {'unit':7} {'ratio':>6}  goal")
    with worktree(baseline) as base_tree:
        for kind in ("fast", "pending"):
            counts = {
                tree: [instructions(tree, kind, n) for n in sizes] for tree in (ROOT, base_tree)
            }
            for i in range(1, len(sizes)):
                step = sizes[i] - sizes[i - 1]
                ours, base = (
                    (counts[tree][i] - counts[tree][i - 1]) / step for tree in (ROOT, base_tree)
                )
                label = "await of complete work" if kind == "fast" else "a pending wait"
                span = f"{sizes[i - 1]:,}-{sizes[i]:,}"
                ratio = ours / base
                verdict = "ok" if ratio <= 1.03 else "MISS"
                print(
                    f"{label:34} {span:>15} {ours:9,.0f} {base:9,.0f} {'instr':7} "
                    f"{ratio:6.3f}  <= 1.03  {verdict}",
                    flush=True,
                )


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="aiostream-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
            check=True,
            capture_output=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )


def _row(label: str, n: int, ours: float, base: float, unit: str, goal: float) -> str:
    ratio = ours / base
    verdict = "ok" if ratio <= goal else "MISS"
    return (
        f"{label:34} {n:>8,} {ours * 1e6:9.2f} {base * 1e6:9.2f} {unit:7} {ratio:6.3f}"
        f"  <= {goal:<5} {verdict}"
    )


def off_rows(baseline: str, sizes: tuple[int, ...], rounds: int, header: str) -> int:
    """Part 1's rows; the goals missed."""
    missed = 0
    print(header)
    with worktree(baseline) as base_tree:
        for kind, unit in (("fast", "µs/aw"), ("pending", "µs CPU")):
            for n in sizes:
                ours, base = [], []
                for _ in range(rounds):
                    ours.append(child(ROOT, kind, n))
                    base.append(child(base_tree, kind, n))
                label = "await of complete work" if kind == "fast" else "a pending wait"
                row = _row(label, n, statistics.median(ours), statistics.median(base), unit, 1.03)
                missed += row.endswith("MISS")
                print(row, flush=True)
    return missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--baseline", default=BASELINE, help=f"the revision (default {BASELINE})")
    parser.add_argument("--rounds", type=int, default=None, help="child runs per figure")
    parser.add_argument("--only", choices=("off", "on"), help="run one part")
    parser.add_argument(
        "--instructions", action="store_true", help="part 3 only: instructions, with valgrind"
    )
    parser.add_argument("--child", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--once", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), "off")))
        return
    if args.once:
        measure(args.once[0], int(args.once[1]), "off", passes=1)
        return
    if args.instructions:
        instruction_rows(args.baseline)
        return
    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    rounds = args.rounds or (3 if args.quick else 7)
    header = f"{'':34} {'N':>8} {'ours':>9} {'baseline':>9} {'unit':7} {'ratio':>6}  goal"
    missed = 0
    if args.only != "on":
        missed += part_off(args.baseline, sizes, rounds, header)
    if args.only != "off":
        missed += part_on(sizes, rounds, header)
    print(f"\n{missed} goal(s) missed")


def part_off(baseline: str, sizes: tuple[int, ...], rounds: int, header: str) -> int:
    """Part 1's heading and rows (where the clone has the baseline); the goals missed."""
    print(f"1. telemetry off: this checkout against {baseline}, {rounds} rounds, alternated")
    known = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{baseline}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    if known.returncode != 0:
        print(f"skipped: {baseline} is not in this clone's history (a shallow clone?)")
        return 0
    return off_rows(baseline, sizes, rounds, header)


def part_on(sizes: tuple[int, ...], rounds: int, header: str) -> int:
    """Part 2's heading and rows; the goals missed."""
    missed = 0
    print("\n2. telemetry on, against off, in this process (median of rounds)")
    print(header.replace("baseline", "off"))
    for mode, goal in (("tracing", 2.0), ("metrics", 2.0)):
        for kind, unit in (("fast", "µs/aw"), ("pending", "µs CPU")):
            for n in sizes:
                on, off = [], []
                for _ in range(rounds):
                    off.append(measure(kind, n, "off"))
                    on.append(measure(kind, n, mode))
                label = f"{mode}: " + ("await of complete work" if kind == "fast" else "a wait")
                row = _row(label, n, statistics.median(on), statistics.median(off), unit, goal)
                missed += row.endswith("MISS")
                print(row, flush=True)
    return missed


if __name__ == "__main__":
    main()
