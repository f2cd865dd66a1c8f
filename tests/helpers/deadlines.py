"""Deadlines that say what they wait for: a wait that runs out fails with that, not with a
bare ``TimeoutError`` (the suite runs in real time on busy machines, so a deadline is a hang
guard with a wide margin, never a speed goal)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import anyio


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """``anyio.fail_after(seconds)`` on the loop's clock, whose ``TimeoutError`` says ``what``
    was still awaited."""
    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError as exc:
        raise TimeoutError(f"still waiting after {seconds} s for {what}") from exc


async def until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Look at ``condition()`` every millisecond or so until it holds; fail after ``seconds``
    of real time, saying ``what`` did not happen."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"still waiting after {seconds} s for {what}")
        await anyio.sleep(0.001)


def until_blocking(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """:func:`until`, blocking the calling thread (for code that must not reach a checkpoint)."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"still waiting after {seconds} s for {what}")
        time.sleep(0.001)
