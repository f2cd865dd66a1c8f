"""Waits: how a task awaits device work (``synchronize()``), begun and ended here, and the
wait strategies that say how a CUDA wait is watched.

A wait's entry goes to its device's waiter on the running loop (``waiters``): a background
task that watches every pending wait of that device and wakes the tasks whose work completed.
What each strategy does is told there; what aiostream needs of the loop is in ``loops``.
This package is the only one that touches event loops; everything else goes through anyio.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from .. import _diagnostics, _hooks
from .._errors import AiostreamError, DeviceError
from .loops import current_task, in_loop_thread, loop_calls, task_name, threadsafe_caller
from .waiters import Entry, waiter_for

if TYPE_CHECKING:
    from .._backends.base import AnyBackend, WaitTarget

__all__ = [
    "STRATEGIES",
    "WAKE",
    "checkpoint",
    "get_wait_strategy",
    "in_loop_thread",
    "loop_calls",
    "observed",
    "set_wait_strategy",
    "task_name",
    "threadsafe_caller",
    "wait",
    "wait_blocking",
]

checkpoint = anyio.lowlevel.checkpoint

STRATEGIES = ("quiet", "hybrid", "poll", "thread", "callback")  # the default first
#: the strategies whose waits ask the backend to learn of completion promptly
WAKE = frozenset({"hybrid", "callback"})
_ENV = "AIOSTREAM_WAIT_STRATEGY"
#: the strategy of waits that name none, where neither set_wait_strategy() nor the environment
#: chose one: no host function, which on a GPU may hold other streams' work until it has run
DEFAULT_STRATEGY = "quiet"
_strategy: str | None = None  # set_wait_strategy(); None: $AIOSTREAM_WAIT_STRATEGY or quiet


def check_strategy(value: object, what: str = "strategy") -> str:
    """Return ``value`` if it names a strategy; raise TypeError/ValueError otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, one of {', '.join(STRATEGIES)}; got {value!r}")
    if value not in STRATEGIES:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, STRATEGIES))}, got {value!r}")
    return value


def set_wait_strategy(strategy: str | None) -> None:
    """Choose how waits on CUDA devices are watched, for every loop and thread.

    Args:
        strategy: ``"quiet"`` (the default: the loop checks briefly, then the device's
            watcher thread polls the completion flags for longer waits: no host function),
            ``"hybrid"`` (as ``"quiet"``, the watcher woken by a host function instead),
            ``"poll"`` (the loop alone), ``"thread"`` (the watcher alone, polling) or
            ``"callback"`` (the watcher alone, woken by a host function); None goes back to
            ``$AIOSTREAM_WAIT_STRATEGY``, or ``"quiet"`` when it is unset.
            ``await x.synchronize(strategy=...)`` overrides it for one wait. A host function
            pending behind long work may hold the work later submitted to every stream of the
            device until it has run (seen on an H100): choose ``"hybrid"`` or
            ``"callback"`` only where no other stream's work must start meanwhile.

    The virtual backend knows when its work completes, so it ignores the strategy: its waits
    sleep on a loop timer until that moment.
    """
    global _strategy
    _strategy = None if strategy is None else check_strategy(strategy)


def get_wait_strategy() -> str:
    """The strategy waits use when ``synchronize()`` is not given one."""
    if _strategy is not None:
        return _strategy
    env = os.environ.get(_ENV)
    if not env:
        return DEFAULT_STRATEGY
    try:
        return check_strategy(env)
    except ValueError:
        raise ValueError(
            f"{_ENV}={env!r} is not a wait strategy; use one of {', '.join(STRATEGIES)}"
        ) from None


def outcome(error: BaseException | None) -> str:
    """How a wait that ended with ``error`` ended, as the listeners are told (called in the
    waiting task): ``completed``, ``failed`` (a ``DeviceError``), ``cancelled`` (the loop's
    cancellation, a timeout's) or ``error``."""
    if error is None:
        return "completed"
    if isinstance(error, DeviceError):
        return "failed"
    if isinstance(error, (TimeoutError, anyio.get_cancelled_exc_class())):
        return "cancelled"
    return "error"


async def observed(subject: str, device: str, error: BaseException | None = None) -> None:
    """The fast path's checkpoint, told to the listeners as a wait with the strategy
    ``"complete"`` (the work had completed, and failed with ``error`` if given: the caller
    raises it)."""
    if not _hooks.listeners:
        await checkpoint()
        return
    told = _hooks.wait_began(subject, device, "complete")
    try:
        await checkpoint()
    except BaseException as exc:
        _hooks.wait_ended(told, exc, outcome(exc))
        raise
    _hooks.wait_ended(told, error, outcome(error))


def _begun(
    backend: AnyBackend,
    index: int,
    target: WaitTarget,
    subject: object,
    describe: Callable[[Any], str] | None,
    recorded: _diagnostics.Origin | None,
    strategy: str | None,
) -> Entry:
    """A wait's entry, listed among the pending waits (where it began: the caller's caller)."""
    entry = Entry(
        waiter_for(backend, index),
        target,
        current_task(),
        subject,
        describe,
        _diagnostics.capture(3),
        recorded,
        strategy or get_wait_strategy(),
    )
    _diagnostics.register(entry)
    return entry


async def wait(
    backend: AnyBackend,
    index: int,
    target: WaitTarget,
    subject: object,
    recorded: _diagnostics.Origin | None = None,
    strategy: str | None = None,
    describe: Callable[[Any], str] | None = None,
) -> None:
    """Suspend the calling task until ``target`` is done; raise its error if it failed.

    ``subject`` names what is awaited (its words, or the object ``describe`` words when
    someone looks) and ``recorded`` is where its work was recorded (debug mode), for
    :func:`aiostream.pending_waits`; ``strategy`` (checked by the caller) overrides
    :func:`get_wait_strategy`. Cancelling the call removes the wait at once; the device work
    goes on.
    """
    if describe is not None:  # worded now: the listeners are told the words
        subject, describe = describe(subject), None
    entry = _begun(backend, index, target, subject, describe, recorded, strategy)
    waiter = entry.waiter
    told = (
        _hooks.wait_began(entry.subject, entry.device, entry.strategy) if _hooks.listeners else None
    )
    raised: BaseException | None = None
    try:
        waiter.add(entry)
        try:
            parked = entry.parked
            await (parked.wait() if waiter.on_trio else parked)
        except BaseException:
            waiter.discard(entry)
            raise
    except BaseException as exc:
        raised = exc  # cancelled, timed out, or the wait could not begin
        raise
    finally:
        target.release()
        _diagnostics.unregister(entry)
        if told is not None:  # a listener's failure is logged, never raised over the outcome;
            # the outcome: what propagates, else the wait's error
            ended = raised if raised is not None else entry.error
            _hooks.wait_ended(told, ended, outcome(ended))
        told = raised = ended = None  # the frame held by a kept error must not hold these
    error = entry.error
    if error is not None:
        # A program may keep the error: its traceback holds this frame, which must not hold
        # the wait's entry (and through it the waiter and every wait it still lists).
        del entry, waiter
        raise error


def begin(
    backend: AnyBackend,
    index: int,
    target: WaitTarget,
    subject: object,
    recorded: _diagnostics.Origin | None,
    strategy: str | None,
    describe: Callable[[Any], str] | None,
) -> Entry | None:
    """:func:`wait` without a coroutine of its own, for an await that holds the wait in its own
    frame (a pending wait is then one coroutine frame smaller): the wait begun, on which the
    caller awaits :func:`parked`, then calls :func:`end` in a ``finally`` (and
    :func:`cancelled` if the await raised), then raises :func:`failure` if there is one.
    None while listeners are plugged in: the caller awaits :func:`wait`."""
    if _hooks.listeners:
        return None
    entry = _begun(backend, index, target, subject, describe, recorded, strategy)
    waiter = entry.waiter
    try:
        waiter.add(entry)
    except BaseException:
        end(entry)
        raise
    return entry


def parked(entry: Entry) -> Awaitable[Any]:
    """What the waiting task awaits (:func:`begin`)."""
    return entry.parked.wait() if entry.waiter.on_trio else entry.parked  # type: ignore[no-any-return]


def cancelled(entry: Entry) -> None:
    """The await of :func:`parked` raised: the wait is forgotten."""
    entry.waiter.discard(entry)


def end(entry: Entry) -> None:
    """The wait is over, whatever its outcome: its target released, its record gone (and
    the object it was about let go: the waiter may keep the entry a while)."""
    entry.target.release()
    _diagnostics.unregister(entry)
    entry.about = entry.describe = None


def failure(entry: Entry) -> BaseException | None:
    """The error the wait ended with (the device's), if any."""
    return entry.error


def wait_blocking(backend: AnyBackend, target: WaitTarget, what: str) -> None:
    """Block the calling thread until ``target`` is done; refuse to block an event loop."""
    try:
        if in_loop_thread():
            raise AiostreamError(
                f"{what}.synchronize_blocking() would block the event loop running in this "
                f"thread; use 'await {what}.synchronize()' instead"
            )
        backend.wait_blocking(target)
    finally:
        target.release()
