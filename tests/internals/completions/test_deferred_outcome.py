"""White-box: an adapter's ``result`` that defers (``adapters.Deferred``, as Dask's does when
learning a failed task's exception takes a wait) is awaited within the wait's deadline, and
the wait is listed meanwhile, whether the handle was done at the first look or later; the
listeners are told how such a wait ended, and how one whose work had failed did."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aiostream as ais
from aiostream import _hooks
from aiostream.completions import adapters

pytestmark = pytest.mark.anyio


class _Done:
    def __init__(self, at: float) -> None:
        self.at = at

    def done(self) -> bool:
        return anyio.current_time() >= self.at


def _deferring(given: list[float | None], error: BaseException | None = None) -> ais.Adapter:
    """Defers its outcome: an hour's wait, or ``error`` at once; notes the seconds left."""

    async def learn(left: float | None) -> None:
        given.append(left)
        if error is not None:
            raise error
        await anyio.sleep(3600)

    return ais.Adapter("deferring", done="done", result=lambda _: adapters.Deferred(learn))


@pytest.mark.parametrize("done_first", [True, False], ids=["done at first", "done later"])
async def test_a_deferred_outcome_keeps_the_wait_s_deadline(done_first: bool) -> None:
    given: list[float | None] = []
    handle = _Done(anyio.current_time() + (0.0 if done_first else 0.02))
    listed = []

    async def look() -> None:
        await anyio.sleep(0.1)
        listed.extend(ais.pending_waits())

    async with anyio.create_task_group() as tg:
        tg.start_soon(look)
        with pytest.raises(TimeoutError, match="whether it failed was not known"):
            await ais.wait(handle, timeout=0.3, adapter=_deferring(given))
    [left] = given
    assert left is not None and 0.0 <= left <= 0.3 + 1e-6  # (uvloop: its clock, cached)
    [wait] = listed  # while its outcome was learned
    assert wait.strategy == ("complete" if done_first else "poll")
    assert ais.pending_waits() == []


async def test_a_deferred_error_is_raised_and_no_deadline_gives_none() -> None:
    given: list[float | None] = []
    adapter = _deferring(given, KeyError("the work's own"))
    for at in (anyio.current_time(), anyio.current_time() + 0.02):
        with pytest.raises(KeyError, match="the work's own"):
            await ais.wait(_Done(at), adapter=adapter)
    assert given == [None, None]
    with anyio.move_on_after(0.05) as scope:  # an outer deadline cancels the learning too
        await ais.wait(_Done(anyio.current_time()), adapter=_deferring(given))
    assert scope.cancelled_caught


class _Told(_hooks.Listener):
    def __init__(self) -> None:
        self.ended: list[tuple[str, str]] = []

    def _wait_began(self, subject: str, device: str, strategy: str) -> Any:
        return strategy

    def _wait_ended(self, token: Any, error: BaseException | None, outcome: str) -> None:
        self.ended.append((token, outcome))


@pytest.fixture
def told() -> Iterator[_Told]:
    listener = _Told()
    _hooks.add_listener(listener)
    try:
        yield listener
    finally:
        _hooks.remove_listener(listener)


async def test_listeners_hear_how_done_work_ended(told: _Told) -> None:
    failed: concurrent.futures.Future[None] = concurrent.futures.Future()
    failed.set_exception(KeyError("the work's own"))
    with pytest.raises(KeyError):
        await ais.wait(failed)  # done at the first look: the fast path
    given: list[float | None] = []
    with pytest.raises(KeyError):
        await ais.wait(_Done(0.0), adapter=_deferring(given, KeyError("deferred")))
    with pytest.raises(TimeoutError):
        await ais.wait(_Done(0.0), adapter=_deferring(given), timeout=0.01)
    assert told.ended == [("complete", "error"), ("complete", "error"), ("complete", "cancelled")]
