"""``aiostream.wait()`` of Dask ``distributed`` futures, on a local in-process cluster: they
call back (never polled), a failed task raises its own exception, with a synchronous client or
an asynchronous one, and a wait needs nothing of Dask's own loop thread once the task is done
(``Future.result()`` would fetch the value through it)."""

from __future__ import annotations

import contextlib
import importlib.util
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

_UVLOOP = ("asyncio", {"use_uvloop": True})


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


def _value() -> bytes:
    return b"x" * 1024


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


@contextlib.contextmanager
def _loop_thread_held(client: Any, seconds: float) -> Iterator[threading.Event]:
    """Dask's loop thread held until the block is over, or for ``seconds`` at most; yields an
    event set if the hold ran out first."""
    holding, release, ran_out = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        if not release.wait(seconds):
            ran_out.set()

    client.loop.add_callback(hold)
    assert holding.wait(10), "Dask's loop thread never ran the hold"
    try:
        yield ran_out
    finally:
        release.set()


async def test_a_done_task_is_awaited_without_dask_s_loop_thread(client: Any) -> None:
    future = client.submit(_value, pure=False)
    with deadline(30, "a dask task"):
        await ais.wait(future)
    with _loop_thread_held(client, 5) as ran_out:
        await ais.wait(future)  # done: returns at once, its loop thread still held
    assert not ran_out.is_set(), "the wait waited for Dask's loop thread"
    assert future.result() == b"x" * 1024


async def test_a_cancelled_task_raises_dask_s_cancelled_error(client: Any) -> None:
    GATE.clear()
    future = client.submit(_held, pure=False)
    try:
        future.cancel()
        with pytest.raises(distributed.client.FutureCancelledError), deadline(30, "a task"):
            await ais.wait(future)
    finally:
        GATE.set()


async def test_a_failed_task_s_wait_keeps_its_deadline_while_dask_s_loop_is_held(
    client: Any,
) -> None:
    failed = client.submit(_broken, pure=False)
    with pytest.raises(KeyError), deadline(30, "a failing dask task"):
        await ais.wait(failed)
    with _loop_thread_held(client, 10) as ran_out:
        # the task's exception is asked of Dask's loop thread: not known by the deadline
        with pytest.raises(TimeoutError, match="whether it failed was not known"):
            await ais.wait(failed, timeout=0.2)
        with anyio.move_on_after(0.2) as scope:
            await ais.wait(failed)
        assert scope.cancelled_caught
    assert not ran_out.is_set(), "a wait waited for Dask's loop thread past its deadline"


@pytest.mark.parametrize(  # Dask's asynchronous client runs on asyncio's loops, not on trio
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(
            _UVLOOP,
            id="uvloop",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
            ),
        ),
    ],
)
async def test_a_failed_task_of_an_asynchronous_client_raises_its_own(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    async with distributed.Client(
        processes=False,
        n_workers=1,
        threads_per_worker=1,
        dashboard_address=":0",  # (with None its scheduler warned that 8787 was taken)
        asynchronous=True,
    ) as client:
        failed = client.submit(_broken, pure=False)
        finished = client.submit(_value, pure=False)
        with deadline(30, "an asynchronous client's tasks"):
            with pytest.raises(KeyError, match="the task's own"):
                await ais.wait(failed)
            await ais.wait(finished)
        assert await finished == b"x" * 1024
