"""Loop integration: turns backend completion into task wake-ups.

This is the only module that knows about event loops. Each (event loop, backend, device) has one
:class:`_Waiter`: a background task that watches every pending wait of that device and wakes the
tasks whose work completed. It keeps the waits of each stream (a *lane*) in a heap ordered by
their place on the stream: work on one stream completes in order, so only the head of each lane
is ever checked, and a sweep costs in proportion to the number of streams, not of waits.

Between sweeps the waiter sleeps as long as the backend says nothing can change
(``Backend.wake_hint``: the exact time of the next completion on the virtual backend), and is
woken early by a new wait or by the backend's notification (a manual clock advanced, from any
thread). It exits when nothing is pending, so an idle program has no task of ours.

A backend that cannot tell when work completes (CUDA: ``completion_times`` is False) is watched
with a *strategy*, chosen per wait (see :func:`set_wait_strategy`):

- ``poll``: check on the next loop turns for ``SPIN_S`` after the last progress, then sleep for
  half the time since then, up to ``POLL_CAP_S``: latency stays within half of the wait, and a
  long wait costs one check every ``POLL_CAP_S``.
- ``thread``: hand the wait to a thread at once; the thread blocks in the driver on a
  blocking-sync marker (``Backend.block``, no CPU) and the loop resumes when it returns. Each
  stream has at most one such thread, as only the head of each lane is handed over.
- ``hybrid`` (the default): ``poll`` for the first ``HYBRID_HANDOFF_S`` of a wait, then
  ``thread``: short waits are caught by the cheap checks, long ones cost no CPU.
- ``callback``: the driver calls a host function when the work completes
  (``Backend.notify_done``), which wakes the loop from the driver's thread. It runs Python on
  that thread: see the deadlock caveat in the README. A slow check every
  ``CALLBACK_SAFETY_S`` covers host functions the driver never runs (after a device failure).

Everything else goes through anyio; the loop-specific pieces are how a background task is
spawned and how a foreign thread wakes the loop (``call_soon_threadsafe`` on asyncio and uvloop,
``TrioToken.run_sync_soon`` on trio).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import sniffio

from . import _diagnostics
from ._errors import AiostreamError

if TYPE_CHECKING:
    from ._backends.base import Backend, WaitTarget

__all__ = [
    "STRATEGIES",
    "Observer",
    "checkpoint",
    "get_wait_strategy",
    "in_loop_thread",
    "observed",
    "set_wait_strategy",
    "wait",
    "wait_blocking",
]

logger = logging.getLogger("aiostream")

checkpoint = anyio.lowlevel.checkpoint

_waiters: anyio.lowlevel.RunVar[dict[tuple[int, int], _Waiter]] = anyio.lowlevel.RunVar(
    "aiostream_waiters"
)
_COMPACT_MIN = 64

STRATEGIES = ("hybrid", "poll", "thread", "callback")
SPIN_S = 100e-6  #: poll: check every loop turn this long after progress
POLL_CAP_S = 2e-3  #: poll: the longest sleep between checks
HYBRID_HANDOFF_S = 1e-3  #: hybrid: a wait this old goes to a thread
CALLBACK_SAFETY_S = 0.05  #: callback: the slow check for host functions that never run
_ENV = "AIOSTREAM_WAIT_STRATEGY"
_strategy: str | None = None  # set_wait_strategy(); None: $AIOSTREAM_WAIT_STRATEGY or hybrid


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
        strategy: ``"hybrid"`` (the default: poll briefly, then a thread), ``"poll"``,
            ``"thread"`` or ``"callback"`` (opt-in: runs Python on a driver thread); None
            goes back to ``$AIOSTREAM_WAIT_STRATEGY``, or ``"hybrid"`` when it is unset.
            ``await x.synchronize(strategy=...)`` overrides it for one wait.

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
        return "hybrid"
    try:
        return check_strategy(env)
    except ValueError:
        raise ValueError(
            f"{_ENV}={env!r} is not a wait strategy; use one of {', '.join(STRATEGIES)}"
        ) from None


class Observer:
    """Told about every await on an event or stream (the profiler is one)."""

    def now(self) -> float:
        raise NotImplementedError

    def on_await(self, task: str, subject: str, device: str, start: float, end: float) -> None:
        raise NotImplementedError


#: The active observer, or None: the fast path checks only this.
observer: Observer | None = None


def task_name() -> str:
    """The current task's name (anyio's, on any loop)."""
    info = anyio.get_current_task()
    return info.name or f"task {info.id}"


async def observed(subject: str, device: str) -> None:
    """The fast path's checkpoint, reported to the observer as a zero-wait await."""
    obs = observer
    start = obs.now() if obs is not None else 0.0
    await checkpoint()
    if obs is not None:
        obs.on_await(task_name(), subject, device, start, obs.now())


class _Entry:
    __slots__ = (
        "dead",
        "error",
        "event",
        "finished",
        "handed",
        "record",
        "scope",
        "since",
        "strategy",
        "target",
    )

    def __init__(self, target: WaitTarget, record: _diagnostics._Record, strategy: str) -> None:
        self.target = target
        self.record = record
        self.strategy = strategy
        self.since = anyio.current_time()  # loop time, for the watchdog and hybrid's hand-off
        self.event = anyio.Event()
        self.error: BaseException | None = None
        self.finished = False
        self.dead = False
        self.handed = False  # given to a thread (thread, hybrid) or to the driver (callback)
        self.scope: anyio.CancelScope | None = None  # the thread's task, to abandon it


def _loop_hooks() -> tuple[
    Callable[[Callable[[], Awaitable[None]]], object], Callable[[Callable[[], object]], object]
]:
    """Return (spawn a background task, schedule a callback from any thread) for this loop."""
    if sniffio.current_async_library() == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        return trio.lowlevel.spawn_system_task, token.run_sync_soon
    loop = asyncio.get_running_loop()
    return (lambda fn: loop.create_task(fn())), loop.call_soon_threadsafe  # type: ignore[arg-type,return-value]


class _Waiter:
    """Watches the pending waits of one device for one event loop."""

    def __init__(self, backend: Backend, index: int, registry: dict[tuple[int, int], _Waiter]):
        self._backend = backend
        self._index = index
        self._registry = registry
        self._key = (id(backend), index)
        self._spawn, self._call_soon_threadsafe = _loop_hooks()
        self._lanes: dict[Hashable, list[tuple[int, int, _Entry]]] = {}
        self._by_age: deque[_Entry] = deque()  # for the watchdog: oldest first
        self._order = itertools.count()
        self._pending = 0
        self._dead = 0
        self._running = False
        self._kicked = False
        self._scope: anyio.CancelScope | None = None
        self._task: object = None
        self._exact = backend.completion_times
        self._progress_at = 0.0  # loop time of the last progress, for poll's back-off
        self._tg: anyio.abc.TaskGroup | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        #: how many times a target was checked; the tests read it to prove stream-order sweeps
        self.checks = 0

    # ------------------------------------------------------------------ called by waiting tasks

    def add(self, target: WaitTarget, record: _diagnostics._Record, strategy: str) -> _Entry:
        entry = _Entry(target, record, strategy)
        self._progress_at = entry.since
        self._by_age.append(entry)
        heap = self._lanes.get(target.lane)
        if heap is None:
            heap = self._lanes[target.lane] = []
        heapq.heappush(heap, (target.seq, next(self._order), entry))
        self._pending += 1
        if self._running:
            self._kick()
        else:
            self._running = True
            self._task = self._spawn(self._run)
        return entry

    def discard(self, entry: _Entry) -> None:
        """Forget a wait whose task was cancelled."""
        if entry.finished or entry.dead:
            return
        entry.dead = True
        if entry.scope is not None:
            entry.scope.cancel()  # abandon its thread: the marker is returned when it is done
        self._pending -= 1
        self._dead += 1
        if self._dead >= _COMPACT_MIN and self._dead > self._pending:
            self._compact()
        if not self._pending:
            self._kick()  # let the waiter see it has nothing left and exit

    # ------------------------------------------------------------------ the waiter task

    def _kick(self) -> None:
        self._kicked = True
        if self._scope is not None:
            self._scope.cancel()

    def _kick_threadsafe(self) -> None:
        try:
            self._call_soon_threadsafe(self._kick)
        except RuntimeError:
            pass  # the loop has closed: a late wake-up is harmless

    def _compact(self) -> None:
        for lane, heap in list(self._lanes.items()):
            live = [item for item in heap if not item[2].dead]
            if live:
                heapq.heapify(live)
                self._lanes[lane] = live
            else:
                del self._lanes[lane]
        self._dead = 0

    def _watchdog(self) -> float | None:
        """Warn about waits past the threshold; return the seconds until the next one is due."""
        threshold = _diagnostics.watchdog_threshold()
        ages = self._by_age
        if threshold is None:
            # Nothing to watch: drop settled entries cheaply, and compact now and then so that
            # one long wait at the head does not keep every later, finished one alive.
            while ages and (ages[0].finished or ages[0].dead):
                ages.popleft()
            if len(ages) > 2 * self._pending + _COMPACT_MIN:
                self._by_age = deque(e for e in ages if not (e.finished or e.dead))
            return None
        watched = [e for e in ages if not (e.finished or e.dead or e.record.warned)]
        self._by_age = deque(watched)
        if not watched:
            return None
        now = anyio.current_time()
        _diagnostics.warn_late([e.record for e in watched if now - e.since >= threshold])
        pending = [e.since for e in watched if not e.record.warned]
        return min(pending) + threshold - now if pending else None

    def _finish(self, entry: _Entry, error: BaseException | None) -> None:
        if entry.scope is not None:
            entry.scope.cancel()
        entry.finished = True
        entry.error = error
        self._pending -= 1
        entry.event.set()

    def _sweep(self) -> list[_Entry]:
        """Wake every wait whose work completed, checking only the head of each lane.

        Returns the heads still pending.
        """
        heads = []
        for lane, heap in list(self._lanes.items()):
            while heap:
                entry = heap[0][2]
                if entry.dead:
                    heapq.heappop(heap)
                    self._dead -= 1
                    continue
                self.checks += 1
                try:
                    done = entry.target.done()
                except AiostreamError as exc:  # the device failed, or the backend was reset
                    self._finish(entry, exc)
                    heapq.heappop(heap)
                    continue
                if not done:
                    heads.append(entry)
                    break
                self._finish(entry, None)
                heapq.heappop(heap)
            if not heap:
                del self._lanes[lane]
        return heads

    # ------------------------------------------------------------------ strategies

    def _plan(self, heads: list[_Entry]) -> float | None:
        """Apply each pending head's strategy; return how long to sleep (None: until kicked)."""
        now = anyio.current_time()
        delay: float | None = None
        for entry in heads:
            strategy = entry.strategy
            if strategy == "thread":
                self._hand_off(entry)
                continue
            if strategy == "callback":
                self._notify(entry)
                due = CALLBACK_SAFETY_S
            else:
                quiet = now - self._progress_at
                due = 0.0 if quiet < SPIN_S else min(POLL_CAP_S, quiet / 2)
                if strategy == "hybrid":
                    age = now - entry.since
                    if age >= HYBRID_HANDOFF_S:
                        self._hand_off(entry)
                        continue
                    due = min(due, HYBRID_HANDOFF_S - age)
            delay = due if delay is None else min(delay, due)
        return delay

    def _hand_off(self, entry: _Entry) -> None:
        if not entry.handed:
            entry.handed = True
            assert self._tg is not None
            self._tg.start_soon(self._block, entry)

    async def _block(self, entry: _Entry) -> None:
        with anyio.CancelScope() as scope:
            entry.scope = scope
            await anyio.to_thread.run_sync(
                self._backend.block, entry.target, abandon_on_cancel=True, limiter=self._limiter
            )
        entry.scope = None
        self._kick()

    def _notify(self, entry: _Entry) -> None:
        if not entry.handed:
            entry.handed = True
            try:
                self._backend.notify_done(entry.target, self._kick_threadsafe)
            except AiostreamError:
                pass  # the device failed: the next check raises its error into the wait

    async def _run(self) -> None:
        unsubscribe = self._backend.subscribe(self._index, self._kick_threadsafe)
        try:
            if self._exact:
                await self._watch()
            else:
                self._limiter = anyio.CapacityLimiter(1_000_000)  # one thread per stream at most
                while self._pending:  # again if a wait came while the task group was closing
                    async with anyio.create_task_group() as tg:
                        self._tg = tg
                        try:
                            await self._watch()
                        finally:
                            tg.cancel_scope.cancel()  # abandon threads of waits no one needs
        except anyio.get_cancelled_exc_class():
            self._abandon(
                AiostreamError(
                    f"aiostream's waiter for device {self._index} was cancelled "
                    "(is the event loop shutting down?)"
                )
            )
            raise
        except Exception as exc:  # a bug: never crash the loop, never leave a wait hanging
            logger.exception("aiostream waiter failed; failing its pending waits")
            self._abandon(AiostreamError(f"aiostream's waiter failed: {exc!r}"))
        finally:
            self._scope = None
            self._tg = None
            self._running = False
            unsubscribe()
            if not self._pending and self._registry.get(self._key) is self:
                del self._registry[self._key]

    async def _watch(self) -> None:
        while self._pending:
            self._kicked = False
            # The hint first, then the sweep: the hint brings the backend up to date, so a
            # completion it processes is seen by the sweep. (The other way round, a wait
            # completing between the two could be slept on for ever.)
            delay = self._backend.wake_hint(self._index)
            pending = self._pending
            heads = self._sweep()
            if not self._pending:
                break
            if not self._exact:
                if self._pending < pending:
                    self._progress_at = anyio.current_time()
                delay = self._plan(heads)
            due = self._watchdog()
            if due is not None:
                delay = due if delay is None else min(delay, due)
            if self._kicked:
                continue
            with anyio.CancelScope() as scope:
                self._scope = scope
                if delay is None:
                    await anyio.sleep_forever()
                else:
                    await anyio.sleep(delay)
            self._scope = None

    def _abandon(self, error: BaseException) -> None:
        for heap in self._lanes.values():
            for _, _, entry in heap:
                if not entry.dead and not entry.finished:
                    self._finish(entry, error)
        self._lanes.clear()
        self._by_age.clear()
        self._dead = 0


def _waiter(backend: Backend, index: int) -> _Waiter:
    try:
        registry = _waiters.get()
    except LookupError:
        registry = {}
        _waiters.set(registry)
    waiter = registry.get((id(backend), index))
    if waiter is None or waiter._backend is not backend:
        waiter = registry[(id(backend), index)] = _Waiter(backend, index, registry)
    return waiter


async def wait(
    backend: Backend,
    index: int,
    target: WaitTarget,
    subject: str,
    recorded: _diagnostics.Origin | None = None,
    strategy: str | None = None,
) -> None:
    """Suspend the calling task until ``target`` is done; raise its error if it failed.

    ``subject`` names what is awaited and ``recorded`` is where its work was recorded (debug
    mode), for :func:`aiostream.pending_waits`; ``strategy`` (checked by the caller) overrides
    :func:`get_wait_strategy`. Cancelling the call removes the wait at once; the device work
    goes on.
    """
    obs = observer
    start = obs.now() if obs is not None else 0.0
    task = task_name()
    device = f"{backend.kind}:{index}"
    record = _diagnostics._Record(task, subject, device, _diagnostics.capture(2), recorded)
    key = _diagnostics.register(record)
    try:
        waiter = _waiter(backend, index)
        entry = waiter.add(target, record, strategy or get_wait_strategy())
        try:
            await entry.event.wait()
        except BaseException:
            waiter.discard(entry)
            raise
    finally:
        target.release()
        _diagnostics.unregister(key)
        if obs is not None:
            obs.on_await(task, subject, device, start, obs.now())
    if entry.error is not None:
        raise entry.error


def in_loop_thread() -> bool:
    """Return whether an event loop (asyncio, uvloop or trio) runs in this thread."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return True
        except RuntimeError:
            pass
    return False


def wait_blocking(backend: Backend, target: WaitTarget, what: str) -> None:
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
