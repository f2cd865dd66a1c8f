"""What the data loader's tests share (``tests/data/test_loader_*.py``): sources, a way to read
a batch back, the loader's modes, async generators that own a loader, and the wait for what
a block left from another task leaves behind."""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiostream as ais

#: real time, every loop (uvloop too: these need no fake clock)
EVERY_LOOP = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]
#: trio itself refuses a nursery left open in a suspended generator
LOOPS_BUT_TRIO = [p for p in EVERY_LOOP if p.id != "trio"]

#: how a loader is iterated: the options that make each mode
MODES = {
    "plain": None,  # async for, no async with: produced inside __anext__
    "ahead": {},  # inside async with: the loader's own tasks
    "threads": {"workers": 2},  # inside async with, transforms in worker threads
}


def arrays(n: int, size: int = 16) -> Iterator[np.ndarray]:
    """``n`` float32 arrays of ``size``, the i-th filled with i."""
    for i in range(n):
        yield np.full(size, i, dtype=np.float32)


class Counted:
    """``n`` small arrays, counting how many the loader has taken so far."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.n):
            self.pulled += 1
            yield np.full(4, i, np.float32)


async def fetch(buf: ais.DeviceBuffer, stream: ais.Stream) -> np.ndarray:
    """Copy a device buffer back to the host, in order on ``stream``, and wait for it."""
    out = ais.HostBuffer(buf.nbytes)
    ais.copy_async(out, buf, stream=stream)
    await stream.synchronize()
    return out.numpy(buf.dtype, buf.shape).copy()


async def noting_its_close(cleaned: list[bool]) -> AsyncIterator[np.ndarray]:
    """Ten small arrays, asynchronously; closing it awaits (as giving back a connection
    would), then appends to ``cleaned``."""
    try:
        for i in range(10):
            yield np.full(4, i, np.float32)
    finally:
        await anyio.sleep(0.01)
        cleaned.append(True)


async def consume(mode: str, source: object, seen: list[int], **options: object) -> None:
    """Iterate a loader of ``source`` in ``mode`` (MODES), noting each batch's index."""
    kwargs = {**(MODES[mode] or {}), **options}
    if MODES[mode] is None:
        async for batch in ais.DataLoader(source, **kwargs):  # type: ignore[arg-type]
            seen.append(batch.index)
        return
    async with ais.DataLoader(source, **kwargs) as loader:  # type: ignore[arg-type]
        async for batch in loader:
            seen.append(batch.index)


async def indices_from_a_loader(**options: Any) -> AsyncGenerator[int, None]:
    """An async generator that owns an 'async with DataLoader' block."""
    async with ais.DataLoader(arrays(10), workers=2, **options) as loader:
        async for batch in loader:
            yield batch.index


async def close_elsewhere(
    agen: AsyncGenerator[int, None], then: Callable[[], None] = lambda: None
) -> BaseException | None:
    """Close ``agen`` from another task, as a loop's async-generator finalizer does: what
    closing raised, if anything; ``then()`` runs right after, with no checkpoint between."""
    raised: list[BaseException] = []

    async def close() -> None:
        try:
            await agen.aclose()
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            raised.append(exc)
        then()

    async with anyio.create_task_group() as tg:
        tg.start_soon(close)
    return raised[0] if raised else None


#: what a block left from another task leaves running: its worker threads, which the loader
#: cannot wait for there
LEFT_BEHIND = (
    "the loader's worker threads, left behind by a block left from another task, let go of "
    "its stream, events and buffers"
)


async def until_released(what: str, seconds: float = 10.0) -> None:
    """Wait, in real time, until no stream, event or buffer is alive on the virtual backend
    (the garbage collected at each look); fail after ``seconds``, saying that ``what`` did not
    happen and what is still alive. Drop the test's own references to them first."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        stats = ais.virtual.stats()
        if (stats.streams, stats.events, stats.buffers) == (0, 0, 0):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"still waiting after {seconds} s for {what}; alive on the virtual backend: {stats}"
            )
        await anyio.sleep(0.01)
