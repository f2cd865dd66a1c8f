"""Foreign waits seen as GPU waits are: by the Prometheus metrics (the handle's kind as the
device), by the profiler (an await span), and forgotten with their loop when it closes with
them pending."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import Iterator

import anyio
import prometheus_client
import pytest

import aiostream as ais
import aiostream.metrics
from tests.helpers.deadlines import until

pytestmark = pytest.mark.anyio


class Never:
    def done(self) -> bool:
        return False


@pytest.fixture
def registry() -> Iterator[prometheus_client.CollectorRegistry]:
    registry = prometheus_client.CollectorRegistry()
    with aiostream.metrics.PrometheusMetrics(registry, stuck_after=0.05):
        yield registry


def value(registry: prometheus_client.CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_metrics_count_foreign_waits_by_kind_and_see_them_pending(
    registry: prometheus_client.CollectorRegistry,
) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        await ais.wait(pool.submit(time.sleep, 0.02))
    done = {"device": "concurrent.futures", "strategy": "callback", "outcome": "completed"}
    assert value(registry, "aiostream_wait_seconds_count", **done) == 1
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: ais.wait(Never()))
        await until(
            lambda: value(registry, "aiostream_stuck_waits", device="tests.Never") == 1,
            "the polled wait to be stuck",
        )
        tg.cancel_scope.cancel()
    cancelled = {"device": "tests.Never", "strategy": "poll", "outcome": "cancelled"}
    assert value(registry, "aiostream_wait_seconds_count", **cancelled) == 1


async def test_the_profiler_sees_a_foreign_wait_as_an_await() -> None:
    begun = threading.Event()  # the read starts once its wait has begun: 20 ms of it are seen

    def read() -> None:
        begun.wait(10)
        time.sleep(0.02)

    with ais.profile() as prof:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(ais.wait, pool.submit(read), what="a read"))
                await until(lambda: ais.pending_waits() != [], "the wait to begin")
                begun.set()
    [span] = [s for s in prof.spans if s.name.startswith("await a read")]
    assert span.end - span.start >= 0.02
    assert span.args["device"] == "concurrent.futures"


def test_a_loop_closed_with_foreign_waits_pending_forgets_them() -> None:
    loop = asyncio.new_event_loop()
    task = loop.create_task(ais.wait(Never(), what="left behind"))
    loop.run_until_complete(asyncio.sleep(0.01))
    assert [w.subject.split(":")[0] for w in ais.pending_waits()] == ["left behind"]
    loop.close()  # the task stays unfinished for good
    assert ais.pending_waits() == []
    del task
