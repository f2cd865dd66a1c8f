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
  stream has at most one such thread, as only the head of each lane is handed over. The
  threads are daemons of aiostream's own (:class:`_Blockers`): interpreter exit never waits
  for device work, as it would for anyio's worker threads on asyncio.
- ``hybrid`` (the default): ``poll`` for the first ``HYBRID_HANDOFF_S`` of a wait, then
  ``thread``: short waits are caught by the cheap checks, long ones cost no CPU.
- ``callback``: the driver runs a host function when the work completes, and the backend
  calls back (``Backend.notify_done``) from a thread of its own, never the driver's: no Python
  runs on a driver thread. A slow check every ``CALLBACK_SAFETY_S`` covers host functions the
  driver never runs (after a device failure).

Everything else goes through anyio; the loop-specific pieces are how a background task is
spawned and how a foreign thread wakes the loop (``call_soon_threadsafe`` on asyncio and uvloop,
``TrioToken.run_sync_soon`` on trio).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import math
import os
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.lowlevel
import sniffio

from . import _diagnostics, _hooks
from ._errors import AiostreamError

if TYPE_CHECKING:
    from ._backends.base import AnyBackend, WaitTarget, WatchedTarget

__all__ = [
    "STRATEGIES",
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
_loop_time = anyio.current_time  # the loop's clock, read through one name (tests freeze it)
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


def task_name() -> str:
    """The current task's name (anyio's, on any loop)."""
    info = anyio.get_current_task()
    return info.name or f"task {info.id}"


def _current_task() -> object:
    """The running task itself (asyncio's or trio's), whose name is read only if needed."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_task()
    return asyncio.current_task()


def _task_name_of(task: object) -> str:
    name = getattr(task, "name", None)  # trio
    if name is None:
        get_name = getattr(task, "get_name", None)  # asyncio
        name = get_name() if get_name is not None else None
    return name or f"task {id(task)}"


async def observed(subject: str, device: str) -> None:
    """The fast path's checkpoint, reported to the observer as a zero-wait await."""
    obs = _hooks.observer
    start = _hooks.now(obs) if obs is not None else 0.0
    await checkpoint()
    if obs is not None:
        _hooks.on_await(obs, task_name(), subject, device, start)


class _Entry:
    """One pending wait. Small on purpose: a program may have 100,000 of them."""

    __slots__ = (
        "dead",
        "error",
        "finished",
        "handed",
        "parked",
        "record",
        "since",
        "strategy",
        "target",
        "waiter",
    )

    def __init__(
        self,
        waiter: _Waiter,
        target: WaitTarget,
        record: _diagnostics.Record,
        strategy: str,
        parked: Any,
    ) -> None:
        self.waiter = waiter
        self.target = target
        self.record = record
        self.strategy = strategy
        self.since = _loop_time()  # loop time, for the watchdog and hybrid's hand-off
        # what the waiting task sleeps on: a future (asyncio, uvloop) or a trio.Event, both
        # far smaller than an anyio.Event with its queue of waiters
        self.parked = parked
        self.error: BaseException | None = None
        self.finished = False
        self.dead = False
        self.handed = False  # given to a thread (thread, hybrid) or to the driver (callback)

    def __call__(self) -> None:
        """The backend says the work completed (``WaitTarget.watch``); any thread."""
        self.waiter.completed(self)


def _loop_hooks() -> tuple[
    Callable[[Callable[[], Awaitable[None]]], object],
    Callable[[Callable[[], object]], object],
    Callable[[], Any],
    bool,
]:
    """Return (spawn a background task, schedule a callback from any thread, make what a
    wait parks on, whether that is a ``trio.Event``) for this loop: a future on asyncio and
    uvloop; trio has no futures."""
    if sniffio.current_async_library() == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        return trio.lowlevel.spawn_system_task, token.run_sync_soon, trio.Event, True
    loop = asyncio.get_running_loop()
    spawn = lambda fn: loop.create_task(fn())  # noqa: E731
    return spawn, loop.call_soon_threadsafe, loop.create_future, False


def threadsafe_caller() -> Callable[[Callable[[], object]], object]:
    """For the running loop: a function any thread may call with a callback, which the loop
    then runs soon (``call_soon_threadsafe`` on asyncio and uvloop, the trio token's
    ``run_sync_soon``). It does not wait for the loop."""
    return _loop_hooks()[1]


class _Waiter:
    """Watches the pending waits of one device for one event loop.

    The base keeps the task's life (spawned on the first wait, gone when none is left), the
    wake-ups (:meth:`_kick`, coalesced: one per loop turn however many arrive), the watchdog,
    and the failure of every wait if the task dies. Each wake calls :meth:`_sweep`, which
    the two kinds below define: neither visits waits that cannot have progressed.
    """

    def __init__(self, backend: AnyBackend, index: int, registry: dict[tuple[int, int], _Waiter]):
        self.backend = backend
        self._index = index
        self._registry = registry
        self._key = (id(backend), index)
        self._spawn, self._call_soon_threadsafe, self._park, self.on_trio = _loop_hooks()
        self._thread = threading.get_ident()
        #: the device's name, shared by every wait's record
        self.device = f"{backend.kind}:{index}"
        self._by_age: deque[_Entry] = deque()  # every unsettled wait, oldest first
        self._due: deque[_Entry] = deque()  # told complete, not finished yet (any thread appends)
        self._pending = 0
        self._running = False
        self._kicked = False
        self._scope: anyio.CancelScope | None = None
        # The task, strongly referenced: asyncio keeps only weak references to its tasks.
        self._task: object = None
        #: how many times a target was checked, and how many times the waiter looked; the tests
        #: read them to prove that a wake visits only what can have progressed
        self.checks = 0
        self.wakes = 0

    # ------------------------------------------------------------------ called by waiting tasks

    def add(self, target: WaitTarget, record: _diagnostics.Record, strategy: str) -> _Entry:
        entry = _Entry(self, target, record, strategy, self._park())
        self._by_age.append(entry)
        self._pending += 1
        self._added(entry)
        if not self._running:
            self._running = True
            self._task = self._spawn(self._run)
        return entry

    def discard(self, entry: _Entry) -> None:
        """Forget a wait whose task was cancelled."""
        if entry.finished or entry.dead:
            return
        entry.dead = True  # a thread blocked on it returns when the work is done, unheeded
        self._pending -= 1
        self._discarded(entry)
        if not self._pending:
            self._kick()  # let the waiter see it has nothing left and exit

    def _added(self, entry: _Entry) -> None:
        raise NotImplementedError

    def _discarded(self, entry: _Entry) -> None:
        pass

    def completed(self, entry: _Entry) -> None:
        """A target's work completed (or failed, or its backend closed); any thread."""
        self._due.append(entry)
        # In the loop's thread a kick is needed only while we sleep (told by another task);
        # awake, we are in our own sweep, which finishes what it was told.
        if self._scope is not None or threading.get_ident() != self._thread:
            self._kick_threadsafe()

    # ------------------------------------------------------------------ the waiter task

    def _kick(self) -> None:
        if self._kicked:
            return  # one wake-up is on its way already
        self._kicked = True
        if self._scope is not None:
            self._scope.cancel()

    def _kick_threadsafe(self) -> None:
        if threading.get_ident() == self._thread:
            self._kick()
        else:
            self._soon_threadsafe(self._kick)

    def _soon_threadsafe(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` in the loop's thread soon; from any thread."""
        try:
            self._call_soon_threadsafe(fn)
        except RuntimeError:
            pass  # the loop has closed: a late wake-up is harmless

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
        now = _loop_time()
        _diagnostics.warn_late([e.record for e in watched if now - e.since >= threshold])
        pending = [e.since for e in watched if not e.record.warned]
        return min(pending) + threshold - now if pending else None

    def _finish(self, entry: _Entry, error: BaseException | None) -> None:
        entry.finished = True
        entry.error = error
        self._pending -= 1
        parked = entry.parked
        if self.on_trio:
            parked.set()
        elif not parked.done():  # else cancelled: its task is on its way out
            parked.set_result(None)

    def _check(self, entry: _Entry) -> bool:
        """Check one wait; finish it if its work completed or failed. Return whether it did."""
        self.checks += 1
        try:
            done = entry.target.done()
        except AiostreamError as exc:  # the device failed, or the backend was reset
            self._finish(entry, exc)
            return True
        if done:
            self._finish(entry, None)
        return done

    def _sweep(self) -> float | None:
        """Finish the waits that can have completed; return how long to sleep at most
        (None: until kicked)."""
        raise NotImplementedError

    async def _run(self) -> None:
        unsubscribe = self.backend.subscribe(self._index, self._kick_threadsafe)
        try:
            await self._serve()
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
            self._running = False
            unsubscribe()
            if not self._pending and self._registry.get(self._key) is self:
                del self._registry[self._key]

    async def _serve(self) -> None:
        await self._watch()

    async def _watch(self) -> None:
        while self._pending:
            self._kicked = False
            self.wakes += 1
            delay = self._sweep()
            if not self._pending:
                break
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
        for entry in self._by_age:
            if not entry.dead and not entry.finished:
                self._finish(entry, error)
        self._by_age.clear()
        self._abandoned()

    def _abandoned(self) -> None:
        pass


class _TimedWaiter(_Waiter):
    """For backends that know when work completes (the virtual one).

    Each wait asks its target to be told of the completion (``WaitTarget.watch``); the
    backend tells it from whichever thread processes the completion, and the waiter finishes
    just those waits. Between wakes it sleeps until the backend's next completion
    (``Backend.wake_hint``), or until kicked by a manual clock or by work that ends sooner.
    A wake costs O(1) per completed wait; pending waits are never visited.
    """

    def _added(self, entry: _Entry) -> None:
        target = cast("WatchedTarget", entry.target)  # completion_times promises it
        target.watch(entry)

    def _sweep(self) -> float | None:
        # The hint first: it brings the backend up to date, which tells the targets whose
        # work completed; then those are finished. (The other way round, a completion
        # between the two could be slept on.)
        delay = self.backend.wake_hint(self._index)
        due = self._due
        while due:
            entry = due.popleft()
            if not (entry.dead or entry.finished):
                self._check(entry)
        return delay


class _StrategyWaiter(_Waiter):
    """For backends that cannot tell when work completes (CUDA): waits watched by strategy.

    Waits on one stream (a *lane*) complete in order, so only the head of each lane is
    watched, by its strategy: polled heads in one batch when the poll is due, heads handed to
    a thread or to a host function when that reports back. A wake visits only those lanes.
    """

    def __init__(self, backend: AnyBackend, index: int, registry: dict[tuple[int, int], _Waiter]):
        super().__init__(backend, index, registry)
        self._lanes: dict[Hashable, list[tuple[int, int, _Entry]]] = {}
        self._order = itertools.count()
        self._dead = 0
        self._visit: dict[Hashable, None] = {}  # lanes that may have progressed
        self._polled: dict[Hashable, None] = {}  # lanes whose head is polled (poll, hybrid)
        self._called: dict[Hashable, None] = {}  # lanes whose head waits for a host function
        self._poll_at = 0.0  # loop time of the next poll of ``_polled`` (back-off)
        self._handoff_at = math.inf  # loop time of the next hybrid hand-off among them
        self._safety_at = 0.0  # loop time of the next check for host functions that never ran
        self._progress_at = 0.0  # loop time of the last progress, for poll's back-off

    def _added(self, entry: _Entry) -> None:
        self._progress_at = entry.since
        lane = entry.target.lane
        heap = self._lanes.get(lane)
        if heap is None:
            heap = self._lanes[lane] = []
        heapq.heappush(heap, (entry.target.seq, next(self._order), entry))
        if heap[0][2] is entry:  # a new head: it needs a look
            self._visit[lane] = None
            self._kick()

    def _discarded(self, entry: _Entry) -> None:
        self._dead += 1
        if self._dead >= _COMPACT_MIN and self._dead > self._pending:
            self._compact()
        self._visit[entry.target.lane] = None  # its lane may have a new head to watch
        self._kick()

    def _compact(self) -> None:
        for lane, heap in list(self._lanes.items()):
            live = [item for item in heap if not item[2].dead]
            if live:
                heapq.heapify(live)
                self._lanes[lane] = live
            else:
                del self._lanes[lane]
                self._polled.pop(lane, None)
                self._called.pop(lane, None)
        self._dead = 0

    def _report(self, lane: Hashable) -> None:
        """The thread or host function watching ``lane``'s head returned (loop thread)."""
        self._visit[lane] = None
        self._kick()

    def _sweep(self) -> float | None:
        now = _loop_time()
        visit, self._visit = self._visit, {}
        poll = bool(self._polled) and now >= min(self._poll_at, self._handoff_at)
        if poll:
            visit.update(self._polled)
            self._handoff_at = math.inf  # the visits below set it again
        if self._called and now >= self._safety_at:
            # Host functions never run once a device failed: one check of one head tells
            # (errors are sticky per device), and then every such lane is visited.
            self._safety_at = now + CALLBACK_SAFETY_S
            lane = next(iter(self._called))
            heap = self._lanes.get(lane)
            if heap is None or heap[0][2].dead or self._check(heap[0][2]):
                visit.update(self._called)
        pending = self._pending
        for lane in visit:
            self._sweep_lane(lane, now)
        if self._pending < pending:
            self._progress_at = now
        if poll or self._pending < pending:
            quiet = now - self._progress_at
            self._poll_at = now + (0.0 if quiet < SPIN_S else min(POLL_CAP_S, quiet / 2))
        delay: float | None = None
        if self._polled:
            delay = max(0.0, min(self._poll_at, self._handoff_at) - now)
        if self._called:
            safety = max(0.0, self._safety_at - now)
            delay = safety if delay is None else min(delay, safety)
        if self._visit:  # a lane reported back while we swept
            delay = 0.0
        return delay

    def _sweep_lane(self, lane: Hashable, now: float) -> None:
        """Finish the lane's completed waits in order, then watch its new head."""
        heap = self._lanes.get(lane)
        while heap:
            entry = heap[0][2]
            if entry.dead:
                heapq.heappop(heap)
                self._dead -= 1
                continue
            if entry.finished or self._check(entry):
                heapq.heappop(heap)
                continue
            self._plan(lane, entry, now)
            return
        self._lanes.pop(lane, None)
        self._polled.pop(lane, None)
        self._called.pop(lane, None)

    def _plan(self, lane: Hashable, entry: _Entry, now: float) -> None:
        """Watch a pending head by its strategy."""
        strategy = entry.strategy
        if strategy == "hybrid" and now - entry.since >= HYBRID_HANDOFF_S:
            strategy = "thread"
        if strategy == "thread":
            self._polled.pop(lane, None)
            self._hand_off(lane, entry)
        elif strategy == "callback":
            self._polled.pop(lane, None)
            self._called[lane] = None
            self._notify(lane, entry)
        else:  # poll, or hybrid until its hand-off
            if lane not in self._polled:
                self._polled[lane] = None
                self._poll_at = min(self._poll_at, now)  # a new head: poll it next turn
            if strategy == "hybrid":
                self._handoff_at = min(self._handoff_at, entry.since + HYBRID_HANDOFF_S)

    def _hand_off(self, lane: Hashable, entry: _Entry) -> None:
        if not entry.handed:
            entry.handed = True
            _blockers.run(functools.partial(self._block, lane, entry))

    def _block(self, lane: Hashable, entry: _Entry) -> None:
        """In a blocker thread: block until the head is done, then tell the loop."""
        try:
            self.backend.block(entry.target)
        finally:
            self._soon_threadsafe(functools.partial(self._blocked, lane, entry))

    def _blocked(self, lane: Hashable, entry: _Entry) -> None:
        entry.handed = False  # were it somehow not done, the next look hands it again
        self._report(lane)

    def _notify(self, lane: Hashable, entry: _Entry) -> None:
        if not entry.handed:
            entry.handed = True
            report = functools.partial(self._report_threadsafe, lane)
            try:
                self.backend.notify_done(entry.target, report)
            except AiostreamError:
                pass  # the device failed: the next check raises its error into the wait

    def _report_threadsafe(self, lane: Hashable) -> None:
        self._soon_threadsafe(functools.partial(self._report, lane))

    def _abandoned(self) -> None:
        self._lanes.clear()
        self._polled.clear()
        self._called.clear()
        self._visit.clear()
        self._dead = 0


class _Blockers:
    """The daemon threads that block in the driver for the ``thread`` strategy.

    Daemons, so that interpreter exit (Ctrl-C included) never waits for device work; an idle
    one takes the next job, and leaves after ``IDLE_S`` without one.
    """

    IDLE_S = 10.0

    def __init__(self) -> None:
        self._jobs: SimpleQueue[Callable[[], object]] = SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._names = itertools.count(1)

    def run(self, job: Callable[[], object]) -> None:
        with self._lock:  # ``_idle``: threads waiting for a job, less the jobs queued
            self._jobs.put(job)
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            name = f"aiostream blocker {next(self._names)}"
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.IDLE_S)
            except Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._idle -= 1
                        return
                continue
            try:
                job()
            except Exception:  # never lose the thread to a job's failure
                logger.exception("aiostream: a blocking wait failed")
            with self._lock:
                self._idle += 1


_blockers = _Blockers()


def _waiter(backend: AnyBackend, index: int) -> _Waiter:
    try:
        registry = _waiters.get()
    except LookupError:
        registry = {}
        _waiters.set(registry)
    waiter = registry.get((id(backend), index))
    if waiter is None or waiter.backend is not backend:
        kind = _TimedWaiter if backend.completion_times else _StrategyWaiter
        waiter = registry[(id(backend), index)] = kind(backend, index, registry)
    return waiter


async def wait(
    backend: AnyBackend,
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
    obs = _hooks.observer
    start = _hooks.now(obs) if obs is not None else 0.0
    task = _current_task()
    waiter = _waiter(backend, index)
    device = waiter.device
    record = _diagnostics.Record(
        task, _task_name_of, subject, device, _diagnostics.capture(2), recorded
    )
    key = _diagnostics.register(record)
    try:
        entry = waiter.add(target, record, strategy or get_wait_strategy())
        try:
            parked = entry.parked
            await (parked.wait() if waiter.on_trio else parked)
        except BaseException:
            waiter.discard(entry)
            raise
    finally:
        target.release()
        _diagnostics.unregister(key)
        if obs is not None:  # its own failure is logged, never raised over the wait's outcome
            _hooks.on_await(obs, _task_name_of(task), subject, device, start)
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
