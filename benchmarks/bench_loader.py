"""The data loader's overlap, in virtual time (exact), against its ideal and a sequential run.

A pipeline of 200 batches with four stages of chosen durations: a host transform, the
host-to-device copy, compute, and the device-to-host copy of the result (each copy takes
latency + nbytes / bandwidth; the bandwidth is set to give the chosen copy time). The
measured throughput is compared with the ideal 1 / max(stage) (goal: at least 0.95 of it),
and the same work run sequentially with 1 / sum(stages). Peak buffers in use: at most
prefetch + 2.

Usage: python benchmarks/bench_loader.py [--batches 200] [--quick]
"""

from __future__ import annotations

import argparse
import platform

import aiostream as ais
from aiostream import _demo
from aiostream.testing import run_in_virtual_time

LATENCY = 10e-6
SCENARIOS = {  # (host, copy, compute) in ms
    "compute-bound": (2.0, 1.0, 3.0),
    "host-bound": (4.0, 1.0, 2.0),
    "copy-bound": (1.0, 3.0, 2.0),
    "balanced": (2.0, 2.0, 2.0),
}


def measure(
    loop: str, batches: int, host_ms: float, copy_ms: float, compute_ms: float, prefetch: int
) -> tuple[_demo.PipelineResult, _demo.PipelineResult, float]:
    nbytes = 64 * 1024
    bandwidth = nbytes / (copy_ms / 1000 - LATENCY)
    cfg = _demo.PipelineConfig(
        batches=batches,
        nbytes=nbytes,
        host_s=host_ms / 1000,
        compute_s=compute_ms / 1000,
        prefetch=prefetch,
        device=ais.Device("virtual", 0),
    )
    options = {"bandwidth": bandwidth, "latency": LATENCY}
    pipe = run_in_virtual_time(_demo.run_pipeline, cfg, backend=loop, **options)
    seq = run_in_virtual_time(_demo.run_sequential, cfg, backend=loop, **options)
    return pipe, seq, max(host_ms, copy_ms, compute_ms) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--loops", default="asyncio,trio")
    parser.add_argument("--quick", action="store_true", help="20 batches: a smoke run")
    args = parser.parse_args()
    batches = 20 if args.quick else args.batches
    print(f"aiostream {ais.__version__}, Python {platform.python_version()}; virtual time "
          f"(exact), {batches} batches, prefetch {args.prefetch}\n")
    print(f"{'loop':8} {'scenario':14} {'stages host/copy/compute ms':28} "
          f"{'pipelined/ideal':>16} {'sequential/(1/sum)':>19} {'peak buffers':>13} check")
    for loop in args.loops.split(","):
        for name, (host, copy, compute) in SCENARIOS.items():
            pipe, seq, slowest = measure(loop, batches, host, copy, compute, args.prefetch)
            ideal = 1 / slowest
            serial = 1 / ((host + 2 * copy + compute) / 1000)  # the d2h copy is a stage too
            ok = pipe.checksum_ok and seq.checksum_ok
            print(
                f"{loop:8} {name:14} {f'{host:g} / {copy:g} (+{copy:g} d2h) / {compute:g}':28} "
                f"{pipe.batches_per_s / ideal:16.3f} {seq.batches_per_s / serial:19.3f} "
                f"{f'{pipe.peak_in_use} <= {args.prefetch + 2}':>13} "
                f"{'ok' if ok else 'CHECKSUM MISMATCH'}"
            )


if __name__ == "__main__":
    main()
