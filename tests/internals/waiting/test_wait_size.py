"""What a pending wait costs in memory: under 2 KiB, its task included, from 1,000 waits on
(``pending_memory`` of ``benchmarks/cuda_waits.py``, tracemalloc); and what it is made of: the
waiting task's own coroutine holds the wait (no coroutine of the waiter's per wait), and one
object is both the waiter's entry and the pending-wait listing's record."""

from __future__ import annotations

import gc

import anyio
import pytest

import aiostream as ais
from aiostream import _diagnostics, _waiting
from aiostream._waiting import waiters
from aiostream.virtual import VirtualClock
from benchmarks.cuda_waits import pending_memory

pytestmark = pytest.mark.anyio

KIB = 1024


@pytest.mark.parametrize("on", ["events", "streams"])
def test_a_pending_wait_is_under_2_kib(on: str) -> None:
    assert pending_memory("virtual:0", 2000, on) < 2 * KIB


async def test_a_pending_wait_is_one_coroutine_and_one_entry(clock: VirtualClock) -> None:
    streams = [ais.Stream() for _ in range(100)]
    for s in streams:
        ais.delay(1.0, stream=s)
    async with anyio.create_task_group() as tg:
        for s in streams:
            tg.start_soon(s.synchronize)
        await anyio.wait_all_tasks_blocked()
        gc.collect()
        objects = gc.get_objects()
        coroutines = [o for o in objects if getattr(o, "__qualname__", None) == "wait"]
        assert not [c for c in coroutines if getattr(c, "cr_code", None) is _waiting.wait.__code__]
        records = [o for o in objects if isinstance(o, _diagnostics.Record)]
        assert len(records) == 100 and all(isinstance(r, waiters.Entry) for r in records)
        clock.advance(1000.0)  # (one compute slot: the kernels run one after another)
