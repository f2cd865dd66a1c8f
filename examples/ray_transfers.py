"""Device work and transfers awaited on Ray's event loops: an async actor, and a Ray Data
callable class with ``async def __call__``.

Both fetch rows' features from a ``Store`` actor elsewhere in the cluster (a transfer: the
call's ``ObjectRef.future()`` is a ``concurrent.futures.Future``, and ``await ais.wait(...)``
of it is called back, never polled), then send them through their device and back
(``await ais.wait(stream)``), without blocking their event loop:

- ``Worker``, an async actor, answers ``ping()`` while ``step()`` awaits; a ping made mid-step
  sees the step's wait in ``ais.pending_waits()``, with its kind and strategy.
- ``Features``, a callable class for ``Dataset.map_batches``: Ray Data runs several of its
  batches at once on the one event loop of each of its actors, so the batches' awaits overlap
  (each row says when its batch began and ended).

    python -m pip install ".[ray]"   # Ray and Ray Data (pandas, pyarrow); from a checkout
    python examples/ray_transfers.py              # virtual:0 in each actor
    python examples/ray_transfers.py --gpus       # num_gpus=1 each: cuda:0 is its own GPU

Without a GPU each actor simulates its own ``virtual:0`` (its work takes real time); with
``--gpus`` each asks Ray for a GPU and uses ``cuda:0``, the GPU Ray gave it. The waits keep
aiostream's contract: a ``timeout=`` names what was late, the watchdog and the metrics see them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import numpy as np
import ray

import aiostream as ais


def open_device(device: str) -> ais.Device:
    """``device`` in this Ray worker; a virtual one is this process's own simulation."""
    if device.startswith("virtual"):
        ais.virtual.reset(devices=1)
    return ais.device(device)


async def fetch(store: Any, ids: np.ndarray, seconds: float) -> np.ndarray:
    """The features of ``ids``, from the store actor: a transfer across the cluster."""
    future = store.lookup.remote(ids, seconds).future()
    await ais.wait(future, timeout=60, what=f"features of {len(ids)} rows")
    features: np.ndarray = future.result()
    return features


async def round_trip(device: ais.Device, values: np.ndarray, ms: float) -> np.ndarray:
    """``values`` up to the device, ``ms`` of kernels there, and back."""
    nbytes = values.size * 4
    host = ais.HostBuffer(nbytes, device=device)
    host.numpy(np.float32)[:] = values
    dev = ais.DeviceBuffer(nbytes, device)
    stream = ais.Stream(device)  # a stream per call: calls overlap
    ais.copy_async(dev, host, stream=stream)
    ais.delay(ms / 1e3, stream=stream)  # the kernels
    ais.copy_async(host, dev, stream=stream)
    await ais.wait(stream, timeout=60)  # this task only: the loop runs on
    return host.numpy(np.float32).copy()


@ray.remote
class Store:
    """Rows' features, served after ``seconds`` (another node's store, over the network)."""

    async def lookup(self, ids: np.ndarray, seconds: float) -> np.ndarray:
        await asyncio.sleep(seconds)
        return ids.astype(np.float32) * 2


@ray.remote
class Worker:
    """An async actor: its methods are coroutines on one event loop in its process."""

    def __init__(self, device: str, store: Any) -> None:
        self.device = open_device(device)
        self.store = store

    async def ready(self) -> str:
        return str(self.device)

    async def step(self, n: int, transfer_s: float, ms: float) -> dict[str, Any]:
        """Fetch ``n`` rows' features (``transfer_s``), then ``ms`` of device work on them."""
        began = time.monotonic()
        features = await fetch(self.store, np.arange(n), transfer_s)
        arrived = time.monotonic()
        out = await round_trip(self.device, features, ms)
        return {"began": began, "arrived": arrived, "ended": time.monotonic(), "sum": out.sum()}

    async def ping(self) -> dict[str, Any]:
        """When the loop answered, and the waits pending then."""
        waits = sorted((w.device, w.strategy) for w in ais.pending_waits())
        return {"at": time.monotonic(), "waits": waits}


class Features:
    """A Ray Data callable class: each batch's features, fetched, then through the device."""

    def __init__(self, device: str, store: Any, transfer_s: float, ms: float) -> None:
        self.device = open_device(device)
        self.store = store
        self.transfer_s = transfer_s
        self.ms = ms

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        began = time.monotonic()
        features = await fetch(self.store, batch["id"], self.transfer_s)
        y = await round_trip(self.device, features, self.ms)
        n = len(y)
        return {
            "id": batch["id"],
            "y": y,
            "began": np.full(n, began),
            "ended": np.full(n, time.monotonic()),
        }


async def actor_demo(
    worker: Any, n: int = 1024, transfer_s: float = 0.2, ms: float = 200.0
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A step on ``worker``, and pings every 20 ms while it runs."""
    step = worker.step.remote(n, transfer_s, ms)
    pings = []
    while not ray.wait([step], timeout=0)[0]:
        pings.append(await worker.ping.remote())
        await asyncio.sleep(0.02)
    return await step, pings


def data_demo(
    store: Any,
    gpus: bool,
    rows: int = 64,
    batch: int = 8,
    transfer_s: float = 0.1,
    ms: float = 20.0,
    actors: int = 2,
) -> dict[str, np.ndarray]:
    """``rows`` rows through ``actors`` ``Features`` actors (a GPU each with ``gpus``); their
    columns, sorted by ``id``."""
    ds = ray.data.range(rows, override_num_blocks=2).map_batches(
        Features,
        fn_constructor_kwargs={
            "device": device_of(gpus),
            "store": store,
            "transfer_s": transfer_s,
            "ms": ms,
        },
        batch_size=batch,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=0.5,
        num_gpus=1 if gpus else 0,
    )
    rows = sorted(ds.take_all(), key=lambda row: int(row["id"]))
    return {key: np.array([row[key] for row in rows]) for key in ("id", "y", "began", "ended")}


def device_of(gpus: bool) -> str:
    return "cuda:0" if gpus else "virtual:0"


def overlapped(spans: list[tuple[float, float]]) -> int:
    """The most spans in progress at one moment."""
    edges = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", action="store_true", help="num_gpus=1 each, on cuda:0")
    parser.add_argument("--address", default=None, help="a Ray cluster ('auto'); else local")
    args = parser.parse_args(argv)
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        if args.gpus and ray.cluster_resources().get("GPU", 0) < 1:
            sys.exit("--gpus needs a GPU in the Ray cluster; leave it out for virtual devices")
        options = {"num_gpus": 1} if args.gpus else {}
        store = Store.remote()
        worker = Worker.options(**options).remote(device_of(args.gpus), store)
        print(f"actor on {ray.get(worker.ready.remote())}")
        step, pings = asyncio.run(actor_demo(worker))
        during = [p for p in pings if step["began"] < p["at"] < step["ended"]]
        print(
            f"step: transfer {step['arrived'] - step['began']:.3f} s, device work "
            f"{step['ended'] - step['arrived']:.3f} s; {len(during)} pings answered meanwhile, "
            f"seeing {sorted({w for p in during for w in map(tuple, p['waits'])})}"
        )
        ray.kill(worker)  # its GPU, if it has one, goes to Ray Data's actors
        gpus = int(ray.cluster_resources().get("GPU", 0))
        rows = data_demo(store, args.gpus, actors=min(2, gpus) if args.gpus else 2)
        assert (rows["y"] == rows["id"] * 2).all()
        spans = sorted(set(zip(rows["began"], rows["ended"], strict=True)))
        print(
            f"Ray Data: {len(rows['id'])} rows, features checked; at most {overlapped(spans)} of "
            f"{len(spans)} batches in progress at once"
        )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
