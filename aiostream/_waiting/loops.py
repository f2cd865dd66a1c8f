"""What aiostream needs of the running event loop (asyncio, uvloop or trio): the task's name,
a background task, a call from any thread, what a wait parks on, and whether a loop runs in
this thread. With the rest of ``_waiting``, the only package that touches event loops;
everything else goes through anyio.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import anyio
import sniffio

__all__ = [
    "LoopCalls",
    "current_task",
    "in_loop_thread",
    "loop_calls",
    "task_name",
    "task_name_of",
    "threadsafe_caller",
]


def task_name() -> str:
    """The current task's name (anyio's, on any loop)."""
    info = anyio.get_current_task()
    return info.name or f"task {info.id}"


def current_task() -> object:
    """The running task itself (asyncio's or trio's), whose name is read only if needed."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_task()
    import asyncio  # loaded: it runs this task (never imported for trio programs)

    return asyncio.current_task()


def task_name_of(task: object) -> str:
    name = getattr(task, "name", None)  # trio
    if name is None:
        get_name = getattr(task, "get_name", None)  # asyncio
        name = get_name() if get_name is not None else None
    return name or f"task {id(task)}"


class LoopCalls(NamedTuple):
    """What aiostream needs of the running loop: a background task, a call from any thread,
    what a wait parks on, and whether the loop runs here or has closed."""

    spawn: Callable[[Callable[[], Awaitable[None]]], object]  #: a background task
    soon_threadsafe: Callable[[Callable[[], object]], object]  #: a callback, from any thread
    park: Callable[[], Any]  #: what a wait parks on: a future, or a ``trio.Event``
    on_trio: bool
    running_here: Callable[[], bool]  #: whether the loop runs now, in the calling thread
    #: whether the loop has closed, its tasks left unfinished (asyncio's ``loop.close()``);
    #: trio never leaves them: the run's end cancels the waiter's task and every wait's
    gone: Callable[[], bool]


def loop_calls() -> LoopCalls:
    """The running loop's calls (for the waiters of device work and of foreign handles): a
    future to park on, on asyncio and uvloop; trio has no futures."""
    if sniffio.current_async_library() == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def trio_here() -> bool:
            try:
                return trio.lowlevel.current_trio_token() is token
            except RuntimeError:
                return False

        return LoopCalls(
            trio.lowlevel.spawn_system_task,
            token.run_sync_soon,
            trio.Event,
            True,
            trio_here,
            _never,
        )
    import asyncio  # loaded: it runs this task (never imported for trio programs)

    loop = asyncio.get_running_loop()
    spawn = lambda fn: loop.create_task(fn())  # noqa: E731

    def here() -> bool:
        try:
            return asyncio.get_running_loop() is loop
        except RuntimeError:
            return False

    return LoopCalls(
        spawn, loop.call_soon_threadsafe, loop.create_future, False, here, loop.is_closed
    )


def _never() -> bool:
    return False


def threadsafe_caller() -> Callable[[Callable[[], object]], object]:
    """For the running loop: a function any thread may call with a callback, which the loop
    then runs soon (``call_soon_threadsafe`` on asyncio and uvloop, the trio token's
    ``run_sync_soon``). It does not wait for the loop."""
    return loop_calls().soon_threadsafe


def in_loop_thread() -> bool:
    """Return whether an event loop (asyncio, uvloop or trio) runs in this thread."""
    # Either library runs a loop in this thread only if it was fully imported; while another
    # thread imports it for the first time, the module is there half-made, without the
    # attributes read here.
    get_running_loop = getattr(sys.modules.get("asyncio"), "get_running_loop", None)
    if get_running_loop is not None:
        try:
            get_running_loop()
            return True
        except RuntimeError:
            pass
    current_token = getattr(
        getattr(sys.modules.get("trio"), "lowlevel", None), "current_trio_token", None
    )
    if current_token is not None:
        try:
            current_token()
            return True
        except RuntimeError:
            pass
    return False
