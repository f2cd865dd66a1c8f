"""The example server's ``/health`` (``examples/inference_server.py``, ``Batcher.health``): 503
while a wait older than its bound holds, on the device or on another library's handle, naming
it; 200 again once it clears. In-process, in real time (the age of a wait is wall-clock)."""

from __future__ import annotations

import concurrent.futures
import functools

import anyio
import numpy as np
import pytest

import aiostream as ais
from tests.helpers.deadlines import until
from tests.helpers.process import import_example

for _dist in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_dist, reason='the server example needs pip install -e ".[server]"')

pytestmark = pytest.mark.anyio

server = import_example("inference_server")
MODEL = server.Model(features=4, launch_s=0.040, per_item_s=0.00125)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_health_names_a_stuck_stream_and_clears(virtual_device: ais.Device) -> None:
    """A kernel that does not end (here: the compute engine stalled) holds its batch's wait:
    /health answers 503 naming the stream once that wait is older than the bound, and 200
    again once it clears. In real time: the age of a wait is wall-clock (a bound of 0.5 s, so
    that a loaded machine still sees the wait young first)."""
    batcher = server.Batcher(
        MODEL, ais.device(), max_batch=4, max_wait_s=0.0, lanes=1, stuck_after_s=0.5
    )
    stall = ais.virtual.stall("compute")
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        tg.start_soon(batcher.infer, np.ones(4, np.float32))
        await until(lambda: ais.pending_waits() != [], "the batch to wait on the stalled device")
        assert batcher.health() == (200, {"ok": True})  # waiting, not yet for long
        await until(
            lambda: batcher.health()[0] == 503, "/health to say 503 once the wait is 0.5 s old"
        )
        status, body = batcher.health()
        assert status == 503 and body["ok"] is False and body["waited_s"] >= 0.5
        stall.release()
        await until(lambda: batcher.served >= 1, "the batch to be served once the device runs")
        assert batcher.health() == (200, {"ok": True})
        tg.cancel_scope.cancel()
    (lane_stream,) = {op.stream for op in ais.virtual.timeline()}  # where the batch's work ran
    assert body["stuck"].startswith("event ") and body["stuck"].endswith(
        f" on stream {lane_stream}"
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_health_names_a_stuck_transfer_and_clears(virtual_device: ais.Device) -> None:
    """A wait on another library's handle that does not end (a transfer the app awaits with
    ``ais.wait``) makes /health answer 503 too, naming it and its kind, once it is older than
    the bound; 200 again once it is over."""
    batcher = server.Batcher(MODEL, ais.device(), max_batch=4, max_wait_s=0.0, stuck_after_s=0.3)
    transfer: concurrent.futures.Future[None] = concurrent.futures.Future()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(ais.wait, transfer, what="kv-cache pull from node 2"))
        await until(lambda: ais.pending_waits() != [], "the transfer's wait to begin")
        assert batcher.health() == (200, {"ok": True})  # waiting, not yet for long
        await until(lambda: batcher.health()[0] == 503, "/health to say 503 at 0.3 s")
        status, body = batcher.health()
        assert body["stuck"].startswith("kv-cache pull from node 2"), body
        assert (body["on"], body["waited_s"] >= 0.3) == ("concurrent.futures", True)
        transfer.set_result(None)
        await until(lambda: ais.pending_waits() == [], "the transfer's wait to end")
        assert batcher.health() == (200, {"ok": True})
        tg.cancel_scope.cancel()
