"""Async GPU actors on Ray: an actor per device, fed and gathered with ``await``.

Each ``DeviceActor`` owns one device and a stream on it; its methods are coroutines that Ray
runs on the actor's own event loop, so one actor overlaps many jobs: each job uploads its
items, runs them, downloads the results and awaits its event (``await event.synchronize()``
suspends that job only). The driver fans jobs out round-robin and gathers the results with
``await`` (Ray's object refs are awaitable on asyncio). Every actor profiles what it runs; the
driver merges the actors' Chrome traces into one file, on one time axis, a process per actor.

    python -m pip install ".[ray]"   # from a checkout: aiostream-cuda is not on PyPI yet
    python examples/ray_actors.py --actors 2 --jobs 8 --trace ray_trace.json

Without a GPU each actor simulates its own ``virtual:i`` (its work takes real time). With
``--gpus`` each actor asks Ray for one GPU (``num_gpus=1``) and uses ``cuda:0``, which is the GPU
Ray gave it (Ray sets ``CUDA_VISIBLE_DEVICES`` per actor). On a cluster, start Ray there
(``ray start --head`` on one node, ``ray start --address=HEAD:6379`` on the others) and run this
script on a node with ``--address auto``: the same actors land on the cluster's GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import ray

import aiostream as ais


@ray.remote
class DeviceActor:
    """One device, one stream and one profiler, in a Ray worker process."""

    def __init__(self, device: str) -> None:
        kind, _, index = device.partition(":")
        if kind == "virtual":
            # a simulator of its own, in this process, with virtual:0 .. virtual:index
            ais.virtual.reset(devices=int(index) + 1)
        self.device = ais.device(device)
        self.stream = ais.Stream(self.device)
        self.prof = ais.profile(self.device)
        self.prof.__enter__()  # until trace(): every job is recorded
        # the profile's clock against the wall clock, to put every actor on one time axis
        self.wall_offset = time.time() - self.prof.now()

    async def ready(self) -> str:
        return str(self.device)

    async def run(self, job: int, items: int, item_ms: float) -> float:
        """Run ``items`` items of ``job`` on the device; the sum of what came back."""
        with ais.record_function(f"job {job}", job=job):
            nbytes = items * 4
            host_in = ais.HostBuffer(nbytes, device=self.device)
            host_in.numpy(np.float32)[:] = np.arange(items, dtype=np.float32) + job
            dev = ais.DeviceBuffer(nbytes, self.device)
            host_out = ais.HostBuffer(nbytes, device=self.device)
            stream = ais.Stream(self.device)  # a stream per job: jobs overlap their copies
            with ais.record_function(f"job {job} on device", stream=stream):
                ais.copy_async(dev, host_in, stream=stream)
                ais.delay(items * item_ms / 1e3, stream=stream)  # the job's kernels
                ais.copy_async(host_out, dev, stream=stream)
            await stream.record_event().synchronize()
            return float(host_out.numpy(np.float32).sum())

    async def trace(self) -> dict[str, Any]:
        """End the profile; its Chrome trace and where it starts on the wall clock."""
        self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self.prof.export_chrome_trace(path)
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        assert self.prof.start is not None
        return {
            "device": str(self.device),
            "pid": os.getpid(),
            "wall_start": self.prof.start + self.wall_offset,
            "trace": doc,
        }


def merge_traces(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace from the actors' traces: their times shifted onto the earliest start,
    each actor's processes renumbered and named after the actor."""
    t0 = min(p["wall_start"] for p in parts)
    events: list[dict[str, Any]] = []
    for n, part in enumerate(parts):
        shift_us = (part["wall_start"] - t0) * 1e6
        for event in part["trace"]["traceEvents"]:
            event = dict(event, pid=(n + 1) * 100 + event["pid"])
            if event.get("ph") == "M" and event["name"] == "process_name":
                name = event["args"]["name"]
                event["args"] = {"name": f"actor {n} (pid {part['pid']}): {name}"}
            elif "ts" in event:
                event["ts"] = event["ts"] + shift_us
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": "aiostream"}}


async def fan_out(
    actors: list[Any], jobs: int, items: int, item_ms: float
) -> tuple[list[float], dict[str, Any]]:
    """Jobs round-robin over the actors, all in flight at once; the results in job order, and
    the merged trace."""
    refs = [actors[j % len(actors)].run.remote(j, items, item_ms) for j in range(jobs)]
    results = list(await asyncio.gather(*refs))
    parts = await asyncio.gather(*(a.trace.remote() for a in actors))
    return results, merge_traces(list(parts))


def expected(job: int, items: int) -> float:
    return float(np.sum(np.arange(items, dtype=np.float32) + job))


def start_actors(n: int, gpus: bool) -> list[Any]:
    if gpus:
        return [DeviceActor.options(num_gpus=1).remote("cuda:0") for _ in range(n)]
    return [DeviceActor.remote(f"virtual:{i}") for i in range(n)]


def missing_gpus(actors: int) -> str | None:
    """Why the Ray cluster cannot give ``--gpus`` actors a GPU each, or None: Ray would
    otherwise wait for them forever, repeating that no node can fulfil the request."""
    have = int(ray.cluster_resources().get("GPU", 0))
    if have >= actors:
        return None
    fewer = f"give --actors {have} or fewer, " if have else ""
    return (
        f"--gpus --actors {actors} needs {actors} GPUs (one per actor), and this Ray cluster "
        f"has {have}: {fewer}or leave out --gpus (each actor then simulates a virtual device)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--items", type=int, default=1024, help="items per job")
    parser.add_argument("--item-ms", type=float, default=0.05, help="device time per item")
    parser.add_argument("--gpus", action="store_true", help="an actor per GPU, on cuda:0 each")
    parser.add_argument("--address", default=None, help="a Ray cluster ('auto'); else local")
    parser.add_argument("--trace", default="ray_trace.json", help="where the merged trace goes")
    args = parser.parse_args(argv)
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=max(2, args.actors), include_dashboard=False)
    why = missing_gpus(args.actors) if args.gpus else None
    if why is not None:
        ray.shutdown()
        sys.exit(why)
    try:
        actors = start_actors(args.actors, args.gpus)
        ray.get([a.ready.remote() for a in actors])  # the workers have started
        t = time.perf_counter()
        results, trace = asyncio.run(fan_out(actors, args.jobs, args.items, args.item_ms))
        elapsed = time.perf_counter() - t
    finally:
        ray.shutdown()
    assert results == [expected(j, args.items) for j in range(args.jobs)]
    with open(args.trace, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    device_s = args.jobs * args.items * args.item_ms / 1e3
    print(
        f"{args.jobs} jobs on {args.actors} actors in {elapsed:.2f} s (wall clock; "
        f"{device_s:.2f} s of device work in all, {device_s / args.actors:.2f} s per actor); "
        f"results checked; merged trace: {args.trace}"
    )


if __name__ == "__main__":
    main()
