"""``aiostream.metrics``: Prometheus metrics of waits, stuck waits, device errors, copies and
loader batches, read from a registry as a scrape reads them, on every loop and backend."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import anyio
import numpy as np
import prometheus_client
import pytest

import aiostream as ais
import aiostream.metrics
from tests.helpers import gate
from tests.helpers.deadlines import until

pytestmark = pytest.mark.anyio


@pytest.fixture
def registry() -> Iterator[prometheus_client.CollectorRegistry]:
    registry = prometheus_client.CollectorRegistry()
    with aiostream.metrics.PrometheusMetrics(registry, stuck_after=0.2):
        yield registry


def value(registry: prometheus_client.CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_waits_are_counted_by_outcome_and_pending_ones_are_seen(
    aiostream_device: ais.Device, registry: prometheus_client.CollectorRegistry
) -> None:
    """A wait in progress shows as pending, then as stuck past the threshold; once it ends,
    in the latency histogram, as completed; a timed-out one as cancelled."""
    dev = str(aiostream_device)
    strategy = ais.get_wait_strategy()
    s = ais.Stream(aiostream_device)
    virtual = aiostream_device.type == "virtual"
    # the work waits meanwhile: a stalled virtual device, a gated CUDA stream
    release = ais.virtual.stall("compute").release if virtual else gate.gate(s)
    ais.delay(0.01, stream=s)
    with anyio.move_on_after(0.05):
        await s
    cancelled = {"device": dev, "strategy": strategy, "outcome": "cancelled"}
    assert value(registry, "aiostream_wait_seconds_count", **cancelled) == 1
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.synchronize)
            await until(
                lambda: (
                    value(registry, "aiostream_pending_waits", device=dev, strategy=strategy) == 1
                ),
                "the wait to be pending",
            )
            assert value(registry, "aiostream_stuck_waits", device=dev) == 0
            await until(
                lambda: value(registry, "aiostream_stuck_waits", device=dev) == 1,
                "the wait to be older than 0.2 s",
            )
            assert value(registry, "aiostream_oldest_wait_seconds", device=dev) > 0.2
            release()
    finally:
        release()
    completed = {"device": dev, "strategy": strategy, "outcome": "completed"}
    assert value(registry, "aiostream_wait_seconds_count", **completed) == 1
    assert value(registry, "aiostream_wait_seconds_sum", **completed) > 0.2
    assert value(registry, "aiostream_pending_waits", device=dev, strategy=strategy) == 0
    await s  # complete: the fast path counts as a wait too
    done = {"device": dev, "strategy": "complete", "outcome": "completed"}
    assert value(registry, "aiostream_wait_seconds_count", **done) == 1
    if not virtual:
        gate.sweep()  # the device passed the gate: its word goes now, not at the exit


async def test_copies_and_loader_batches_are_counted(
    aiostream_device: ais.Device, registry: prometheus_client.CollectorRegistry
) -> None:
    dev = str(aiostream_device)
    host, d = (
        ais.HostBuffer(4096, device=aiostream_device),
        ais.DeviceBuffer(4096, aiostream_device),
    )
    s = ais.Stream(aiostream_device)
    ais.copy_async(d, host, stream=s)
    ais.copy_async(host, d, stream=s)
    ais.copy_async(host, d, stream=s)
    await s
    assert value(registry, "aiostream_copied_bytes_total", device=dev, direction="h2d") == 4096
    assert value(registry, "aiostream_copied_bytes_total", device=dev, direction="d2h") == 8192
    items = [np.full(256, i, np.float32) for i in range(5)]
    async with ais.DataLoader(items, device=aiostream_device) as loader:
        async for batch in loader:
            await batch.ready
    assert value(registry, "aiostream_loader_batches_total", device=dev) == 5
    assert value(registry, "aiostream_loader_stall_seconds_total", device=dev) > 0


async def test_device_errors_are_counted(registry: prometheus_client.CollectorRegistry) -> None:
    s = ais.Stream()
    ais.virtual.submit(s, 0.05, error="boom")
    with pytest.raises(ais.DeviceError):
        await s  # pending when awaited: a wait that ends with the device's error
    assert value(registry, "aiostream_device_errors_total", device="virtual:0") == 1
    failed = {"device": "virtual:0", "outcome": "failed", "strategy": ais.get_wait_strategy()}
    assert value(registry, "aiostream_wait_seconds_count", **failed) == 1


async def test_a_cancelled_await_of_complete_work_and_a_wait_a_reset_ended_are_counted(
    registry: prometheus_client.CollectorRegistry,
) -> None:
    """Every way a wait ends has its outcome: an await of complete work cancelled at its
    checkpoint, and a wait whose backend a reset replaced (``StaleHandleError``: ``error``)."""
    s = ais.Stream("virtual:0")
    done = s.record_event()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await done
    fast = {"device": "virtual:0", "strategy": "complete"}
    assert value(registry, "aiostream_wait_seconds_count", **fast, outcome="cancelled") == 1
    assert value(registry, "aiostream_pending_waits", **fast) == 0
    strategy = ais.get_wait_strategy()
    ais.virtual.stall("compute")
    ais.delay(0.01, stream=s)
    async with anyio.create_task_group() as tg:
        waited = anyio.Event()

        async def wait() -> None:
            with pytest.raises(ais.StaleHandleError):
                await s
            waited.set()

        tg.start_soon(wait)
        await until(
            lambda: (
                value(registry, "aiostream_pending_waits", device="virtual:0", strategy=strategy)
                == 1
            ),
            "the wait to be pending",
        )
        ais.virtual.reset()
        with anyio.fail_after(10, shield=True):
            await waited.wait()
    ended = {"device": "virtual:0", "strategy": strategy, "outcome": "error"}
    assert value(registry, "aiostream_wait_seconds_count", **ended) == 1
    assert value(registry, "aiostream_pending_waits", device="virtual:0", strategy=strategy) == 0


def test_registered_twice_or_without_the_client_it_says_what_to_do(
    registry: prometheus_client.CollectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="registered on this registry already"):
        aiostream.metrics.PrometheusMetrics(registry)
    with pytest.raises(ValueError, match="stuck_after"):
        aiostream.metrics.PrometheusMetrics(prometheus_client.CollectorRegistry(), stuck_after=-1)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ais.AiostreamError, match=r"pip install prometheus-client .*\[prometheus\]"):
        aiostream.metrics.PrometheusMetrics()


def test_closed_it_leaves_the_registry(registry: prometheus_client.CollectorRegistry) -> None:
    other = prometheus_client.CollectorRegistry()
    metrics = aiostream.metrics.PrometheusMetrics(other)
    assert "aiostream_pending_waits" in prometheus_client.generate_latest(other).decode()
    metrics.close()
    metrics.close()
    assert prometheus_client.generate_latest(other) == b""


async def test_known_devices_have_every_series_from_the_start_at_0(
    virtual_device: ais.Device, registry: prometheus_client.CollectorRegistry
) -> None:
    """Before any wait, error, copy or batch, each series of a device in use reads 0 (so
    increase() counts the first device error); an idle device's gauges read 0 again."""
    dev, strategy = str(virtual_device), ais.get_wait_strategy()

    def read(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"device": dev, **labels})

    for name in ("device_errors", "loader_batches", "loader_stall_seconds"):
        assert read(f"aiostream_{name}_total") == 0.0, name
    for direction in ("h2d", "d2h", "d2d"):
        assert read("aiostream_copied_bytes_total", direction=direction) == 0.0
    assert read("aiostream_pending_waits", strategy=strategy) == 0.0
    assert read("aiostream_stuck_waits") == 0.0
    assert read("aiostream_oldest_wait_seconds") == 0.0
    s = ais.Stream()
    ais.virtual.submit(s, 0.01, error="illegal address")
    with pytest.raises(ais.DeviceError):
        await s
    assert read("aiostream_device_errors_total") == 1.0
    assert read("aiostream_pending_waits", strategy=strategy) == 0.0  # idle again: still there
    assert read("aiostream_oldest_wait_seconds") == 0.0
