"""What record_function costs when no profiler is active, against contextlib.nullcontext.

Goal: at most 2x. Measured in one run, interleaved rounds, median of rounds.

Usage: python benchmarks/bench_profiler.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import aiostream as ais


def per_call(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn(n)
    return (time.perf_counter() - t) / n


def with_nullcontext(n: int) -> None:
    nullcontext = contextlib.nullcontext
    for _ in range(n):
        with nullcontext():
            pass


def with_record_function(n: int) -> None:
    record_function = ais.record_function
    for _ in range(n):
        with record_function("step"):
            pass


def with_record_function_args(n: int) -> None:
    record_function = ais.record_function
    for i in range(n):
        with record_function("step", batch=i):
            pass


@ais.record_function("decorated")
def decorated() -> None:
    pass


def plain() -> None:
    pass


def call_decorated(n: int) -> None:
    for _ in range(n):
        decorated()


def call_plain_in_nullcontext(n: int) -> None:
    nullcontext = contextlib.nullcontext
    for _ in range(n):
        with nullcontext():
            plain()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, rounds = (20_000, 3) if args.quick else (500_000, 9)
    cases = {
        "with record_function('step')": (with_record_function, with_nullcontext),
        "with record_function('step', batch=i)": (with_record_function_args, with_nullcontext),
        "@record_function decorated call": (call_decorated, call_plain_in_nullcontext),
    }
    print(
        f"aiostream {ais.__version__}, Python {platform.python_version()}, {platform.machine()}; "
        f"no profiler active, {n} calls x {rounds} rounds\n"
    )
    print(f"{'case':40} {'ours':>9} {'nullcontext':>12} {'ratio':>6}  (goal <= 2)")
    for name, (ours_fn, base_fn) in cases.items():
        ours, base = [], []
        for _ in range(rounds):
            base.append(per_call(base_fn, n))
            ours.append(per_call(ours_fn, n))
        o, b = statistics.median(ours), statistics.median(base)
        print(f"{name:40} {o * 1e9:7.0f} ns {b * 1e9:9.0f} ns {o / b:6.2f}")


if __name__ == "__main__":
    main()
