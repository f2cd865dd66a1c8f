"""Prometheus metrics for aiostream: waits, stuck waits, device errors, bytes copied, loader
batches and stalls.

Needs the ``prometheus-client`` package (``pip install prometheus-client``; from aiostream's
checkout, ``pip install -e ".[prometheus]"``).
Nothing is counted until a :class:`PrometheusMetrics` is made; :meth:`PrometheusMetrics.close`
(or leaving its ``with`` block) unregisters it.

Example:
    >>> import prometheus_client  # doctest: +SKIP
    >>> metrics = ais.metrics.PrometheusMetrics(stuck_after=30.0)  # doctest: +SKIP
    >>> prometheus_client.generate_latest()  # doctest: +SKIP

Metrics (``device`` is ``cuda:0``, ``virtual:1``, ...):

- ``aiostream_pending_waits{device,strategy}``: waits in progress now (a gauge read at scrape);
- ``aiostream_stuck_waits{device}``: of those, the ones older than ``stuck_after`` seconds
  (default: the watchdog's threshold, ``aiostream.set_watchdog``; none without one);
- ``aiostream_oldest_wait_seconds{device}``: how long the oldest wait has waited;
- ``aiostream_wait_seconds{device,strategy,outcome}``: a histogram of awaits' durations
  (``outcome``: ``completed``, ``failed``, ``cancelled``, ``error``; ``strategy`` is
  ``complete`` where the work had completed when awaited);
- ``aiostream_device_errors_total{device}``: waits that ended with ``DeviceError`` (a
  device's error is sticky: later awaits on it raise it at once, before any wait begins);
- ``aiostream_copied_bytes_total{device,direction}``: bytes of ``copy_async`` submitted, by
  ``h2d``, ``d2h``, ``d2d``;
- ``aiostream_loader_batches_total{device}`` and ``aiostream_loader_stall_seconds_total{device}``:
  batches a ``DataLoader`` handed out, and the seconds its consumer waited for them.

Every device known (of the backends in use at a scrape, or seen by a hook) has each of these
series from the start, at 0 (``pending_waits`` for the default wait strategy and each one seen
on it): ``increase()`` counts the first device error, and an idle device's gauges read 0.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

from .. import _backends, _check, _diagnostics, _waiting
from .._errors import AiostreamError
from ._listening import Listening

__all__ = ["PrometheusMetrics"]

_EXTRA = (
    'pip install prometheus-client (from aiostream\'s checkout: pip install -e ".[prometheus]")'
)
#: wait durations' buckets, seconds: a checkpoint's microseconds to a stuck kernel's minutes
BUCKETS = (1e-5, 1e-4, 1e-3, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, math.inf)


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise AiostreamError(
            f"aiostream.metrics needs the Prometheus client, which is not installed: {_EXTRA}"
        ) from None
    return prometheus_client


class PrometheusMetrics(Listening):
    """aiostream's metrics on a Prometheus registry (see the module's text for each).

    Args:
        registry: where to register (default: ``prometheus_client.REGISTRY``, which
            ``start_http_server`` and ``generate_latest()`` serve).
        stuck_after: seconds after which a pending wait counts as stuck; None: the watchdog's
            threshold (``aiostream.set_watchdog``), if one is set.

    Raises:
        AiostreamError: ``prometheus-client`` is not installed (it says what to install).
        TypeError: ``registry`` is not a registry, or ``stuck_after`` not a number.
        ValueError: aiostream's metrics are registered on ``registry`` already (one
            ``PrometheusMetrics`` per registry; close the other first), or ``stuck_after`` is
            not a finite number > 0.
    """

    def __init__(self, registry: Any = None, *, stuck_after: float | None = None) -> None:
        if registry is not None and not callable(getattr(registry, "register", 0)):
            raise TypeError(f"registry must be a Prometheus CollectorRegistry, got {registry!r}")
        client = _client()
        if stuck_after is not None:
            stuck_after = _check.seconds(
                stuck_after, "stuck_after", positive=True, what="a number of seconds or None"
            )
        self.stuck_after = stuck_after
        self.registry = registry if registry is not None else client.REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self._families = CounterMetricFamily, GaugeMetricFamily
        self._wait = client.Histogram(
            "aiostream_wait_seconds",
            "Seconds tasks awaited device work, by how the wait ended",
            ["device", "strategy", "outcome"],
            buckets=BUCKETS,
            registry=None,
        )
        self._children: dict[tuple[str, str, str], Any] = {}
        self._counters: dict[str, dict[tuple[str, ...], float]] = {
            "device_errors": {},
            "copied_bytes": {},
            "loader_batches": {},
            "loader_stall_seconds": {},
        }
        self._lock = threading.Lock()  # over the counters: a += is no atomic step
        #: (device, strategy) of the waits begun: their pending_waits series stay, at 0
        self._strategies: set[tuple[str, str]] = set()
        self._collector = _Collector(self)
        try:
            self.registry.register(self._collector)
        except ValueError as exc:
            raise ValueError(
                f"aiostream's metrics are registered on this registry already ({exc}); make "
                "one PrometheusMetrics per registry, or close() the other first"
            ) from None
        self._listen()

    def close(self) -> None:
        """Stop counting and unregister (a second close does nothing)."""
        super().close()

    def _stopped(self) -> None:
        self.registry.unregister(self._collector)

    def __enter__(self) -> PrometheusMetrics:
        return self

    def _add(self, name: str, labels: tuple[str, ...], value: float) -> None:
        counts = self._counters[name]
        with self._lock:  # threads switch between the read and the write
            counts[labels] = counts.get(labels, 0.0) + value

    def _counts(self, name: str) -> dict[tuple[str, ...], float]:
        with self._lock:
            return dict(self._counters[name])

    def _devices(self) -> set[str]:
        """The devices known: those of the backends in use (none made here), and those the
        hooks named."""
        devices = {labels[0] for counts in self._counters.values() for labels in list(counts)}
        devices.update(device for device, _ in list(self._strategies))
        for kind in ("virtual", "cuda"):
            backend = _backends.installed(kind)
            if backend is None:
                continue
            try:
                count = backend.device_count()
            except Exception:  # noqa: BLE001 - a closed or failed backend: none of its devices
                continue
            devices.update(f"{kind}:{i}" for i in range(count))
        return devices

    # ------------------------------------------------------------------ the listener

    def _wait_began(self, subject: str, device: str, strategy: str) -> object:
        if strategy != "complete":  # set.add: one step, whichever thread
            self._strategies.add((device, strategy))
        return time.monotonic(), device, strategy

    def _wait_ended(self, token: object, error: BaseException | None, outcome: str) -> None:
        start: float
        device: str
        strategy: str
        start, device, strategy = token  # type: ignore[misc]
        if outcome == "failed":  # a DeviceError
            self._add("device_errors", (device,), 1)
        key = (device, strategy, outcome)
        child = self._children.get(key)
        if child is None:  # labels() takes a lock and builds a key: once per label set
            child = self._children[key] = self._wait.labels(*key)
        child.observe(time.monotonic() - start)

    def _copied(self, device: str, kind: str, nbytes: int) -> None:
        self._add("copied_bytes", (device, kind), nbytes)

    def _loader_batch(self, device: str, waited: float) -> None:
        self._add("loader_batches", (device,), 1)
        self._add("loader_stall_seconds", (device,), waited)


class _Collector:
    """What a scrape reads: the counters and histogram, and the pending waits as they are."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Any]:
        """The metrics' names, without reading a value: the registry refuses a second
        collector of the same names."""
        counter, gauge = self.metrics._families  # noqa: SLF001
        yield from self.metrics._wait.describe()  # noqa: SLF001
        for name in ("device_errors", "copied_bytes", "loader_batches", "loader_stall_seconds"):
            yield counter(f"aiostream_{name}", name)
        for name in ("pending_waits", "stuck_waits", "oldest_wait_seconds"):
            yield gauge(f"aiostream_{name}", name)

    def collect(self) -> Iterator[Any]:
        m = self.metrics
        counter, gauge = m._families  # noqa: SLF001 - the collector is the class's own part
        yield from m._wait.collect()  # noqa: SLF001
        described = {
            "device_errors": ("waits that raised DeviceError", ["device"]),
            "copied_bytes": ("bytes of copies submitted", ["device", "direction"]),
            "loader_batches": ("batches data loaders handed out", ["device"]),
            "loader_stall_seconds": ("seconds loaders' consumers waited", ["device"]),
        }
        devices = sorted(m._devices())  # noqa: SLF001
        known: dict[str, list[tuple[str, ...]]] = {  # each at 0 until counted
            "device_errors": [(d,) for d in devices],
            "copied_bytes": [(d, k) for d in devices for k in ("h2d", "d2h", "d2d")],
            "loader_batches": [(d,) for d in devices],
            "loader_stall_seconds": [(d,) for d in devices],
        }
        for name, (text, labels) in described.items():
            family = counter(f"aiostream_{name}", text, labels=labels)
            counts = {key: 0.0 for key in known[name]}
            counts.update(m._counts(name))  # noqa: SLF001
            for values, total in counts.items():
                family.add_metric(list(values), total)
            yield family
        waits = _diagnostics.pending_waits()
        pending = gauge(
            "aiostream_pending_waits", "waits in progress", labels=["device", "strategy"]
        )
        by: dict[tuple[str, str], int] = dict.fromkeys(list(m._strategies), 0)  # noqa: SLF001
        try:
            default = _waiting.get_wait_strategy()
        except ValueError:  # a bad AIOSTREAM_WAIT_STRATEGY: said where a wait reads it
            default = None
        if default is not None:
            by.update({(d, default): 0 for d in devices if (d, default) not in by})
        for w in waits:
            key = (w.device, w.strategy or "blocking")
            by[key] = by.get(key, 0) + 1
        for key, n in by.items():
            pending.add_metric(list(key), n)
        yield pending
        threshold = (
            m.stuck_after if m.stuck_after is not None else _diagnostics.watchdog_threshold()
        )
        stuck = gauge(
            "aiostream_stuck_waits",
            "waits in progress longer than the stuck threshold",
            labels=["device"],
        )
        oldest = gauge(
            "aiostream_oldest_wait_seconds",
            "how long the oldest wait has waited",
            labels=["device"],
        )
        first: dict[str, float] = {}
        count: dict[str, int] = {}
        for w in waits:  # longest first
            first.setdefault(w.device, w.waited)
            if threshold is not None and w.waited > threshold:
                count[w.device] = count.get(w.device, 0) + 1
        for device in devices:  # idle: nothing waits there
            first.setdefault(device, 0.0)
        for device, waited in first.items():
            oldest.add_metric([device], waited)
            stuck.add_metric([device], count.get(device, 0))
        yield stuck
        yield oldest
