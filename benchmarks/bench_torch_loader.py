"""The data pipeline as PyTorch users write it, beside aiostream's, on ``cuda:0``.

Needs an NVIDIA GPU and PyTorch; without them it says why and exits. The same work both ways,
per batch: a 1 MiB float32 item, a host transform (numpy math, then ``--host-ms`` of waiting
that stands for decoding), the host-to-device copy, ``--compute-ms`` of compute (a sleep
kernel), a device-to-device copy into an output buffer, its copy back to pinned host memory,
and a checksum of every result against the same math done on the host.

- PyTorch: ``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=W,
  pin_memory=True, persistent_workers=True)``, ``x.to("cuda", non_blocking=True)`` on a
  compute stream, ``torch.cuda._sleep`` for the model, ``copy_(..., non_blocking=True)`` into a
  pinned ring, an event per slot. Worker processes start before the timed epoch.
- aiostream: the demo's pipeline (``python -m aiostream demo --device cuda:0``) with W workers.

It prints batches per second of each and their ratio to the bound ``1 / compute``: both
should be near it when the host keeps up.

Usage: python benchmarks/bench_torch_loader.py [--batches 200] [--workers 2]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from typing import Any

import anyio
import numpy as np

import aiostream as ais
from aiostream import _backends
from aiostream._bench import demo


def skip_reason() -> str | None:
    ok, reason = _backends.probe("cuda")
    if not ok:
        return f"no CUDA device here: {reason}"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


class Items:
    """The dataset, as a map-style dataset (picklable, for worker processes): the demo's."""

    def __init__(self, batches: int, n: int, host_s: float) -> None:
        self.batches, self.host_s = batches, host_s
        self.base = np.arange(n, dtype=np.float32) % 251

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.batches:
            raise IndexError(i)
        out = (self.base + np.float32(i % 7)) * np.float32(0.5) + np.float32(1.0)
        time.sleep(self.host_s)  # heavier preprocessing, as a chosen duration
        return out  # the loader makes it a tensor, then pins it


def torch_pipeline(cfg: demo.PipelineConfig, workers: int) -> tuple[float, bool]:
    """Seconds for the timed epoch, and whether every checksum matched."""
    import torch
    from torch.utils.data import DataLoader

    n = cfg.nbytes // 4
    # cycles for the sleep kernel: calibrated with timing events
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 * cfg.compute_s * 1000 / start.elapsed_time(end))

    loader = DataLoader(
        Items(cfg.batches, n, cfg.host_s),
        batch_size=None,
        num_workers=workers,
        pin_memory=True,
        persistent_workers=workers > 0,
    )
    for _ in loader:  # the workers start, and a first epoch warms everything up
        pass
    depth = 3
    compute = torch.cuda.Stream()
    outputs = [torch.empty(n, dtype=torch.float32, device="cuda") for _ in range(depth)]
    ring = [torch.empty(n, dtype=torch.float32).pin_memory() for _ in range(depth)]
    done: list[Any] = [None] * depth
    total = 0.0
    t0 = time.perf_counter()
    with torch.cuda.stream(compute):
        for i, x in enumerate(loader):
            slot = i % depth
            if done[slot] is not None:
                done[slot].synchronize()
                total += float(ring[slot].sum(dtype=torch.float64))
            dev = x.to("cuda", non_blocking=True)
            torch.cuda._sleep(cycles)  # the model ...
            outputs[slot].copy_(dev, non_blocking=True)  # ... writing its output
            ring[slot].copy_(outputs[slot], non_blocking=True)
            done[slot] = torch.cuda.Event()
            done[slot].record()
        for slot in range(depth):
            if done[slot] is not None:
                done[slot].synchronize()
                total += float(ring[slot].sum(dtype=torch.float64))
    seconds = time.perf_counter() - t0
    expected = demo._expected(cfg)
    return seconds, abs(total - expected) <= 1e-6 * max(1.0, abs(expected))


def aiostream_pipeline(cfg: demo.PipelineConfig) -> tuple[float, bool]:
    async def main() -> demo.PipelineResult:
        await demo.run_pipeline(
            demo.PipelineConfig(batches=8, nbytes=cfg.nbytes, device=cfg.device)
        )  # warm up
        return await demo.run_pipeline(cfg)

    result = anyio.run(main)
    return result.seconds, result.checksum_ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--workers", default="1,2", help="worker counts to compare")
    parser.add_argument("--host-ms", type=float, default=2.0)
    parser.add_argument("--compute-ms", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="20 batches")
    args = parser.parse_args()
    reason = skip_reason()
    if reason is not None:
        print(f"bench_torch_loader: skipped, {reason}")
        return
    import torch

    batches = 20 if args.quick else args.batches
    print(
        f"aiostream {ais.__version__}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {torch.cuda.get_device_name(0)}, "
        f"{datetime.date.today()}; {batches} batches of 1 MiB, host {args.host_ms:g} ms, "
        f"compute {args.compute_ms:g} ms; real time"
    )
    print(f"{'workers':>7} {'pipeline':28} {'batches/s':>10} {'of 1/compute':>13} check")
    bound = 1000 / args.compute_ms
    for workers in map(int, args.workers.split(",")):
        cfg = demo.PipelineConfig(
            batches=batches,
            host_s=args.host_ms / 1000,
            compute_s=args.compute_ms / 1000,
            workers=workers,
            device=ais.Device("cuda", 0),
        )
        rows = [
            ("torch DataLoader, processes", torch_pipeline(cfg, workers)),
            ("aiostream DataLoader", aiostream_pipeline(cfg)),
        ]
        for name, (seconds, ok) in rows:
            rate = batches / seconds
            print(
                f"{workers:7} {name:28} {rate:10.1f} {rate / bound:13.3f} "
                f"{'ok' if ok else 'CHECKSUM MISMATCH'}"
            )


if __name__ == "__main__":
    main()
