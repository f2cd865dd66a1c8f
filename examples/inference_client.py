"""Drive the inference server: many concurrent clients, and a /health probe beside them.

    python examples/inference_client.py http://127.0.0.1:8000 --clients 64 --seconds 5

prints requests/s against the server's device bound and the /health latency (p50, p99) while
the clients run. Each reply must carry its own request's numbers back: a reply mixed up across
a batch counts as an error. ``serving()`` starts ``inference_server.py`` in a subprocess for
tests and benchmarks (``tests/tooling/test_inference_server.py``, ``benchmarks/bench_server.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

SERVER = Path(__file__).with_name("inference_server.py")


@dataclass
class Load:
    """What a load run saw."""

    clients: int
    seconds: float
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


async def load(url: str, *, clients: int, seconds: float, features: int = 4) -> Load:
    """``clients`` tasks, each posting one request after another for ``seconds``.

    Each task has a connection and an ``httpx.AsyncClient`` of its own, made before the clock
    starts (one client shared by many tasks spends its time in its pool, not on the server; and
    each client builds an SSL context unless given one).
    """
    result = Load(clients, seconds)
    tls = ssl.create_default_context()
    https = [httpx.AsyncClient(base_url=url, timeout=30.0, verify=tls) for _ in range(clients)]
    try:
        start = time.perf_counter()
        deadline = start + seconds

        async def client(i: int, http: httpx.AsyncClient) -> None:
            k = 0
            while time.perf_counter() < deadline:
                x = [float(i), float(k)] + [0.5] * (features - 2)
                r = await http.post("/infer", json={"x": x})
                k += 1
                if r.status_code != 200:
                    result.errors.append(f"{r.status_code}: {r.text[:200]}")
                elif r.json()["y"] != x:
                    result.errors.append(f"client {i} sent {x}, got {r.json()['y']}")
                else:
                    result.requests += 1
                    result.batches.append(r.json()["batch"])

        async with anyio.create_task_group() as tg:
            for i, http in enumerate(https):
                tg.start_soon(client, i, http)
        result.seconds = time.perf_counter() - start
    finally:
        for http in https:
            await http.aclose()
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class HealthProbe:
    """GET /health every ``every_s`` from a thread of its own, until stopped; latencies in ms."""

    def __init__(self, url: str, every_s: float = 0.01) -> None:
        self.url, self.every_s = url, every_s
        self.ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while not self._stop.is_set():
                t = time.perf_counter()
                http.get("/health").raise_for_status()
                self.ms.append((time.perf_counter() - t) * 1e3)
                self._stop.wait(self.every_s)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        return {"p50_ms": percentile(self.ms, 0.5), "p99_ms": percentile(self.ms, 0.99)}


@contextlib.contextmanager
def serving(*server_args: str, ready_timeout_s: float = 60.0) -> Iterator[str]:
    """Run ``inference_server.py --port 0 *server_args`` in a subprocess; yield its URL.

    On exit the server gets SIGINT (uvicorn's graceful shutdown) and must exit cleanly.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", "0", *server_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("serving on "):
            proc.kill()
            _, err = proc.communicate(timeout=30)
            raise RuntimeError(f"the server did not start: {line!r}\n{err}")
        url = line.split()[2]
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                httpx.get(url + "/health", timeout=5.0).raise_for_status()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            raise RuntimeError("the server did not shut down within 30 s") from None
    if proc.returncode != 0 or "Traceback" in err:
        raise RuntimeError(f"the server exited with {proc.returncode}:\n{err}")


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/stats", timeout=10.0).json()  # type: ignore[no-any-return]


def measure(url: str, *, clients: int, seconds: float) -> dict[str, Any]:
    """Load the server from a subprocess while this process probes /health, so that neither
    the clients' work nor the GIL they hold delays the probe: its latency is the server's."""
    cmd = [sys.executable, __file__, url, "--clients", str(clients), "--seconds", str(seconds)]
    with HealthProbe(url) as probe:
        done = subprocess.run([*cmd, "--load-only"], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    server = stats(url)
    return {
        **result,
        "bound_rps": server["bound_rps"],
        "of_bound": result["rps"] / server["bound_rps"],
        "health": probe.summary(),
        "server": server,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to send requests")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_only:
        result = anyio.run(lambda: load(args.url, clients=args.clients, seconds=args.seconds))
        batches = result.batches
        summary = {k: v for k, v in asdict(result).items() if k != "batches"}
        summary.update(rps=result.rps, mean_batch=sum(batches) / max(1, len(batches)))
        print(json.dumps(summary))
        return
    summary = measure(args.url, clients=args.clients, seconds=args.seconds)
    if args.json:
        print(json.dumps(summary))
        return
    print(report(summary, args.clients))


def report(summary: dict[str, Any], clients: int) -> str:
    """``measure``'s summary as lines a person reads, each within 100 columns."""
    return (
        f"{summary['requests']} requests in {summary['seconds']:.1f} s from {clients} "
        f"clients: {summary['rps']:.0f} req/s,\n{summary['of_bound']:.2f} of the device bound "
        f"({summary['bound_rps']:.0f} req/s); mean batch {summary['mean_batch']:.1f};\n"
        f"/health p50 {summary['health']['p50_ms']:.1f} ms, p99 "
        f"{summary['health']['p99_ms']:.1f} ms; {len(summary['errors'])} errors"
    )


if __name__ == "__main__":
    main()
