"""The data loader's pipeline in real time against its bound and a sequential run
(``benchmarks/bench_loader.py`` adds worker scaling and virtual-time scenarios)."""

from __future__ import annotations

import statistics

import aiostream as ais

from . import demo
from .core import run_on


def real_time_pipeline(
    loop: str, cfg: demo.PipelineConfig, repeats: int
) -> tuple[float, float, str, bool, str]:
    """Median efficiency and speed-up over ``repeats`` pipelined runs, one sequential run
    measuring the stages, all in one process on ``loop``; the worst peak of buffers in use
    and the pool's size; checks; bottleneck."""

    async def main() -> tuple[demo.PipelineResult, list[demo.PipelineResult]]:
        ais.virtual.reset()  # a fresh device on the monotonic clock
        await demo.run_pipeline(
            demo.PipelineConfig(batches=4, nbytes=cfg.nbytes, device=cfg.device)
        )  # warm up
        seq = await demo.run_sequential(cfg)
        return seq, [await demo.run_pipeline(cfg) for _ in range(repeats)]

    seq, pipes = run_on(loop, main)
    effs, names = [], []
    for p in pipes:
        name, per_batch = demo.bound(seq, p)
        effs.append(seq.batches * per_batch / p.seconds)
        names.append(name)
    speedup = statistics.median(seq.seconds / p.seconds for p in pipes)
    ok = seq.checksum_ok and all(p.checksum_ok for p in pipes)
    slowest = max(set(names), key=names.count)
    peak = f"{max(p.peak_in_use for p in pipes)} <= {pipes[0].pool_size}"
    return statistics.median(effs), speedup, peak, ok, slowest
