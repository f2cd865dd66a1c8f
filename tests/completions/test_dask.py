"""``aiostream.wait()`` of Dask ``distributed`` futures, on a local in-process cluster: they
call back (never polled), and a failed task raises its own exception."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aiostream as ais
from tests.helpers.deadlines import deadline

distributed = pytest.importorskip(
    "distributed", reason="needs Dask's distributed: pip install distributed"
)

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with distributed.Client(
        processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None
    ) as made:
        yield made


GATE = threading.Event()  # the worker runs in this process: it sees the same one


def _held() -> int:
    GATE.wait(30)
    return 42


def _broken() -> None:
    raise KeyError("the task's own")


async def test_a_dask_future_calls_back_when_its_task_ends(client: Any) -> None:
    GATE.clear()
    future = client.submit(_held, pure=False)
    listed = []

    async def release() -> None:
        await anyio.sleep(0.05)
        listed.extend(ais.pending_waits())
        GATE.set()

    with deadline(30, "a dask task"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            await ais.wait(future, what="a shard's load")
    assert future.result() == 42
    [wait] = listed
    assert (wait.device, wait.strategy) == ("dask", "callback")
    assert wait.subject.startswith("a shard's load: dask task _held-")


async def test_a_failed_dask_task_raises_its_own_exception(client: Any) -> None:
    future = client.submit(_broken, pure=False)
    with pytest.raises(KeyError, match="the task's own"), deadline(30, "a failing dask task"):
        await ais.wait(future)
