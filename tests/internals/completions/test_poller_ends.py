"""White-box: the loop's poller of foreign handles ends once nothing is left to ask, a
cancelled wait's handle included (it is asked until its work is done, then let go)."""

from __future__ import annotations

import threading

import anyio
import pytest

import aiostream as ais
from aiostream.completions import waits
from tests.helpers.deadlines import until

pytestmark = pytest.mark.anyio


class _Gated:
    def __init__(self) -> None:
        self.gate = threading.Event()

    def done(self) -> bool:
        return self.gate.is_set()


async def test_the_poller_ends_once_a_cancelled_wait_s_handle_is_done() -> None:
    kept = _Gated()
    with anyio.move_on_after(0.01):
        await ais.wait(kept)
    poller = waits._poller()  # noqa: SLF001
    assert poller._running  # noqa: SLF001 - asking the kept handle until its work is done
    kept.gate.set()
    await until(lambda: not poller._running, "the poller's end")  # noqa: SLF001


async def test_the_poller_ends_once_its_last_wait_is_done() -> None:
    handles = [_Gated() for _ in range(3)]
    async with anyio.create_task_group() as tg:
        for h in handles:
            tg.start_soon(ais.wait, h)
        await anyio.sleep(0.01)
        poller = waits._poller()  # noqa: SLF001
        assert poller._running  # noqa: SLF001
        for h in handles:
            h.gate.set()
    await until(lambda: not poller._running, "the poller's end")  # noqa: SLF001
