"""The inference server example under load, in real (wall-clock) time, against its baselines.

``examples/inference_server.py`` runs in a subprocess (uvicorn, FastAPI), loaded by
``--clients`` httpx clients from another process while this one probes ``/health`` every 10 ms.
For each device bound (max_batch / device time of a full batch; half of a batch's time is a fixed
launch, half is per item) it prints the requests/s reached as a ratio to the bound, the mean
batch, and the /health latency. Baselines, in the same run:

- the HTTP ceiling: the same server and clients with a device that costs nothing (1 us per
  batch), i.e. what this machine's HTTP stack can carry at all;
- /health when idle;
- the same server blocking its loop on each batch (``--blocking``: a busy-wait on
  ``event.query()``, as ``torch.cuda.synchronize()`` in a handler does), at a middle bound.

The device is ``virtual:0`` (its work takes real time) unless ``--device`` says otherwise.

Usage: python benchmarks/bench_server.py [--bounds 100,200,400,800,1600] [--clients 128]
       [--seconds 4] [--device cuda:0] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

try:
    import inference_client as client  # noqa: E402 - the example's harness, in examples/
except ImportError as exc:  # fastapi, uvicorn or httpx missing
    client = None
    MISSING = f"{exc.name} is not installed: python -m pip install '.[server]'"

MAX_BATCH = 32


def server_args(bound: float, device: str, blocking: bool = False) -> list[str]:
    batch_ms = MAX_BATCH / bound * 1e3
    args = ["--device", device, "--max-batch", str(MAX_BATCH)]
    args += [
        "--launch-ms",
        f"{batch_ms / 2:.6f}",
        "--per-item-ms",
        f"{batch_ms / 2 / MAX_BATCH:.6f}",
    ]
    return args + (["--blocking"] if blocking else [])


def point(
    bound: float, device: str, clients: int, seconds: float, blocking: bool = False
) -> dict[str, Any]:
    with client.serving(*server_args(bound, device, blocking)) as url:
        with client.HealthProbe(url) as idle:
            time.sleep(min(1.0, seconds / 2))
        result = client.measure(url, clients=clients, seconds=seconds)
    return {
        "bound_rps": bound,
        "blocking": blocking,
        "rps": result["rps"],
        "of_bound": result["rps"] / bound,
        "mean_batch": result["mean_batch"],
        "errors": len(result["errors"]),
        "health_idle_p99_ms": idle.summary()["p99_ms"],
        "health_p50_ms": result["health"]["p50_ms"],
        "health_p99_ms": result["health"]["p99_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bounds", default="100,200,400,800,1600", help="device bounds, req/s")
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--device", default="virtual:0")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a smoke run: two bounds, 1 s each")
    args = parser.parse_args()
    if client is None:
        print(f"bench_server: skipped, {MISSING}")
        return
    bounds = [float(b) for b in args.bounds.split(",")]
    clients, seconds = args.clients, args.seconds
    if args.quick:
        bounds, clients, seconds = [100.0, 400.0], 32, 1.0
    middle = bounds[len(bounds) // 2]
    ceiling = point(1e6 * MAX_BATCH, args.device, clients, seconds)
    rows = [point(b, args.device, clients, seconds) for b in bounds]
    blocking = point(middle, args.device, clients, seconds, blocking=True)
    ours = next(r for r in rows if r["bound_rps"] == middle)
    report = {
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "device": args.device,
        "clients": clients,
        "seconds": seconds,
        "http_ceiling_rps": ceiling["rps"],
        "rows": rows,
        "blocking": blocking,
        "health_p99_blocking_over_ours": blocking["health_p99_ms"] / ours["health_p99_ms"],
    }
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"# inference server, {clients} clients x {seconds:g} s per row, {args.device}, "
        f"{report['machine']} (real time)"
    )
    print(
        f"HTTP ceiling (a device costing 1 us a batch): {ceiling['rps']:.0f} req/s, "
        f"/health p99 {ceiling['health_p99_ms']:.1f} ms"
    )
    print()
    print(
        "| device bound req/s | req/s | of bound | of HTTP ceiling | mean batch | "
        "/health p50 ms | p99 ms | p99 idle ms | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in [*rows, blocking]:
        label = f"{r['bound_rps']:.0f}" + (" (blocking loop)" if r["blocking"] else "")
        print(
            f"| {label} | {r['rps']:.0f} | {r['of_bound']:.2f} | "
            f"{r['rps'] / ceiling['rps']:.2f} | {r['mean_batch']:.1f} | "
            f"{r['health_p50_ms']:.1f} | {r['health_p99_ms']:.1f} | "
            f"{r['health_idle_p99_ms']:.1f} | {r['errors']} |"
        )
    print()
    print(
        f"/health p99 under load at {middle:.0f} req/s: blocking the loop "
        f"{blocking['health_p99_ms']:.1f} ms, awaiting {ours['health_p99_ms']:.1f} ms "
        f"({report['health_p99_blocking_over_ours']:.1f}x); requests/s "
        f"{blocking['rps']:.0f} vs {ours['rps']:.0f}"
    )


if __name__ == "__main__":
    main()
