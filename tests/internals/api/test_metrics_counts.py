"""``aiostream.metrics``' counters under threads: each count is read and written under a lock,
so counts from many threads add up (the GIL makes no ``+=`` on a dict atomic)."""

from __future__ import annotations

import threading
import time

import prometheus_client

import aiostream.metrics
from aiostream import _hooks


class SlowDict(dict):  # type: ignore[type-arg]
    """A dict whose reads let another thread run before the write that follows them."""

    def get(self, key: object, default: object = None) -> object:
        value = super().get(key, default)
        time.sleep(0.0005)
        return value


def test_counts_from_many_threads_add_up() -> None:
    registry = prometheus_client.CollectorRegistry()
    with aiostream.metrics.PrometheusMetrics(registry) as metrics:
        metrics._counters["copied_bytes"] = SlowDict()  # noqa: SLF001

        def copies() -> None:
            for _ in range(50):
                _hooks.copied("virtual:0", "h2d", 1)

        threads = [threading.Thread(target=copies) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        labels = {"device": "virtual:0", "direction": "h2d"}
        assert registry.get_sample_value("aiostream_copied_bytes_total", labels) == 400
