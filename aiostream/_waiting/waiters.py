"""The waiters: what turns backend completion into task wake-ups (``_waiting`` begins and
ends the waits; this module watches them).

Each (event loop, backend, device) has one
:class:`Waiter`: a background task that watches every pending wait of that device and wakes the
tasks whose work completed. It keeps the waits of each stream (a *lane*) in a heap ordered by
their place on the stream: work on one stream completes in order, so only the head of each lane
is ever checked, and a sweep costs in proportion to the number of streams, not of waits.

Between sweeps the waiter sleeps as long as the backend says nothing can change
(``Backend.wake_hint``: the exact time of the next completion on the virtual backend), and is
woken early by a new wait or by the backend's notification (a manual clock advanced, from any
thread). It exits when nothing is pending, so an idle program has no task of ours.

Every backend tells the waiter when a wait's work completes (``WaitTarget.watch``), from a
thread of its own: the virtual backend from whichever thread moves its simulation, the CUDA
backend from its device's watcher thread (see ``_backends/cuda/watcher.py``: completion flags
the device writes, at most one thread per device whatever the load, no Python on a driver
thread). A CUDA wait's *strategy* (:func:`set_wait_strategy`) says how promptly the backend
learns it, and whether the loop also polls it:

- ``quiet`` (the default): the loop reads the wait's completion flag (``WaitTarget.peek``,
  no driver call) on each of its own turns for a short *check budget* (adaptive: 1.5 times
  the typical length of the device's recent waits, at most ``SPIN_MAX_S``, only
  ``SPIN_MIN_S`` when recent waits were longer; at most ``SPIN_LANES`` streams at once):
  short waits resume without any thread, and cost the stream nothing. Then the loop hands
  the wait to the backend (``watch``), whose watcher polls the completion flags, backing off
  to 2 ms, then to 1 % of the time nothing completed (at most 10 ms; where its wake-ups are
  dear, up to 10 % and 50 ms: ``cuda/watcher.py``). Once the recent waits
  ran alike, a wait handed over is also checked on the loop's turns again near its
  predicted end (from ``NEAR_LEAD_S`` before it), so that a kernel of a few milliseconds
  ends its wait without the watcher's hops. No waiter ever sleeps on a timer shorter than
  the loop honours (``TIMER_FLOOR_S``). No host function: one pending behind long work may
  hold the work later submitted to every stream of the device (seen on an H100).
- ``hybrid``: as ``quiet``, but the watcher is woken by a host function, enqueued after the
  work if nothing followed it, whose word finishes the wait in one hop to the loop: long
  waits cost no CPU.
- ``poll``: the loop alone checks, on its turns for the check budget, then sleeping for half
  the wait's age, at least ``TIMER_FLOOR_S``, up to ``POLL_CAP_S``. No thread, no host
  function.
- ``thread``: the device's watcher alone, which polls the completion flags with the same
  back-off. No host function: nothing is added to the user's stream but the flag's write.
- ``callback``: the watcher alone, woken by the host function.

Everything else goes through anyio; the loop-specific pieces (``loops``) are how a background
task is spawned and how a foreign thread wakes the loop (``call_soon_threadsafe`` on asyncio and
uvloop, ``TrioToken.run_sync_soon`` on trio).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from .. import _diagnostics
from .._errors import AiostreamError
from .loops import loop_calls, task_name_of

if TYPE_CHECKING:
    from .._backends.base import AnyBackend, WaitTarget

__all__ = ["Entry", "Lengths", "StrategyWaiter", "TimedWaiter", "Waiter", "waiter_for"]

logger = logging.getLogger("aiostream")

_registry: anyio.lowlevel.RunVar[dict[tuple[int, int], Waiter]] = anyio.lowlevel.RunVar(
    "aiostream_waiters"
)
#: the lengths of each device's recent waits on this loop (``StrategyWaiter.typical``),
#: kept while no waiter runs: sequential waits each start a waiter of their own
_typical: anyio.lowlevel.RunVar[dict[tuple[int, int], Lengths]] = anyio.lowlevel.RunVar(
    "aiostream_typical_waits"
)
_COMPACT_MIN = 64

#: the strategies whose waits the loop checks for a budget, then hands to the backend
_HANDED = frozenset({"hybrid", "quiet"})
#: the shortest sleep the loop's timer honours: asyncio's selector and trio's epoll round a
#: timeout up to whole milliseconds, so no waiter sleeps less (it checks on the next turn)
TIMER_FLOOR_S = 1e-3
#: the check budget: a wait's first look-ups on the loop's own turns (``WaitTarget.peek``)
#: last 1.5 times the recent waits' typical length plus ``SPIN_MIN_S``, at most ``SPIN_MAX_S``;
#: when recent waits ran longer than that, ``SPIN_MIN_S`` only
SPIN_MIN_S = 50e-6
SPIN_MAX_S = 500e-6
SPIN_LANES = 16  #: at most this many streams' waits are checked on every turn at once
POLL_CAP_S = 2e-3  #: poll: the longest sleep between checks
#: the near-end look: once the device's recent waits on the loop ran alike (their spread at
#: most ``NEAR_SPREAD`` of their mean, which is at most ``NEAR_MAX_S``), a handed wait past
#: its check budget is checked on the loop's turns again from ``NEAR_LEAD_S`` before its
#: predicted end (the loop's timer wakes it no later: its sleep is whole milliseconds, which
#: asyncio and trio honour exactly) to a little after it; the backend has it meanwhile
NEAR_LEAD_S = 250e-6
NEAR_MAX_S = 0.05
NEAR_SPREAD = 0.25
NEAR_SAMPLES = 3  #: the waits seen before any prediction
#: the longest sleep toward a predicted end: a loop's timer may wake a millisecond late after
#: a long one (seen on asyncio for 9 ms sleeps), so a long approach is taken in steps
NEAR_STEP_S = 0.004
_loop_time = anyio.current_time  # the loop's clock, read through one name (tests freeze it)
#: the clock of the check budget: uvloop's loop clock counts whole milliseconds (tests freeze it)
_clock = time.perf_counter
#: the record's clock (``time.monotonic``), where it is the check budget's too (Linux, macOS)
_ONE_CLOCK = (
    time.perf_counter
    if time.get_clock_info("perf_counter").implementation
    == time.get_clock_info("monotonic").implementation
    else None
)
#: gives the CPU to the threads ready to run (none: a no-op), on each turn of a spinning loop
_yield_cpu: Callable[[], object] = getattr(os, "sched_yield", None) or (lambda: None)


class Entry(_diagnostics.Record):
    """One pending wait, and its record for :func:`aiostream.pending_waits` (one object).
    Small on purpose: a program may have 100,000 of them."""

    __slots__ = (
        "dead",
        "error",
        "finished",
        "parked",
        "since",
        "started",
        "target",
    )

    def __init__(
        self,
        waiter: Waiter,
        target: WaitTarget,
        task: object,
        subject: object,
        describe: Callable[[Any], str] | None,
        origin: _diagnostics.Origin | None,
        recorded: _diagnostics.Origin | None,
        strategy: str,
    ) -> None:
        super().__init__(
            task,
            task_name_of,
            subject,
            waiter.device,
            origin,
            recorded,
            waiter,
            strategy,
            describe,
        )
        self.target = target
        self.since = _loop_time()  # loop time, for the watchdog
        # for the check budget; the record's start too where the two clocks are one (a float
        # less per wait)
        self.started = self.start if _clock is _ONE_CLOCK else _clock()
        # what the waiting task sleeps on: a future (asyncio, uvloop) or a trio.Event, both
        # far smaller than an anyio.Event with its queue of waiters
        self.parked = waiter.park()
        self.error: BaseException | None = None
        self.finished = False
        self.dead = False

    @property
    def waiter(self) -> Waiter:
        waiter: Waiter = self.owner  # type: ignore[assignment]
        return waiter

    def __call__(self) -> None:
        """The backend says the work completed (``WaitTarget.watch``); any thread."""
        self.waiter.completed(self)


class Lengths:
    """The lengths of a device's recent waits on one loop: the typical one (each clipped to
    ``4 * SPIN_MAX_S``: the check budget's), and their mean and spread (moving averages,
    one long wait weighing little), which predict when a wait like them ends."""

    __slots__ = ("count", "mean", "spread", "typical")

    def __init__(self) -> None:
        self.count = 0
        self.typical = 0.0
        self.mean = 0.0
        self.spread = 0.0

    def add(self, took: float) -> None:
        clipped = min(took, 4 * SPIN_MAX_S)
        if not self.count:
            self.typical = clipped
            self.mean = took
        else:
            self.typical += (clipped - self.typical) / 4
            took = min(took, 2 * self.mean + TIMER_FLOOR_S)  # an outlier moves it a little
            self.spread += (abs(took - self.mean) - self.spread) / 4
            self.mean += (took - self.mean) / 4
        self.count += 1

    def predicted(self) -> float | None:
        """How long the next wait will take (s), or None: too few waits, or unalike, or
        long ones."""
        if (
            self.count < NEAR_SAMPLES
            or self.mean > NEAR_MAX_S
            or self.spread > NEAR_SPREAD * self.mean
        ):
            return None
        return self.mean


class Waiter:
    """Watches the pending waits of one device for one event loop.

    The base keeps the task's life (spawned on the first wait, gone when none is left), the
    wake-ups (:meth:`_kick`, coalesced: one per loop turn however many arrive), the watchdog,
    and the failure of every wait if the task dies. Each wake calls :meth:`_sweep`, which
    the two kinds below define: neither visits waits that cannot have progressed.
    """

    def __init__(self, backend: AnyBackend, index: int, registry: dict[tuple[int, int], Waiter]):
        self.backend = backend
        self._index = index
        self._registry = registry
        self._key = (id(backend), index)
        calls = loop_calls()
        self._spawn, self._call_soon_threadsafe = calls.spawn, calls.soon_threadsafe
        self.park, self.on_trio, self.gone = calls.park, calls.on_trio, calls.gone
        self._running_here = calls.running_here
        self._thread = threading.get_ident()
        #: the device's name, shared by every wait's record
        self.device = f"{backend.kind}:{index}"
        self._by_age: deque[Entry] = deque()  # every unsettled wait, oldest first
        self._due: deque[Entry] = deque()  # told complete, not finished yet (any thread appends)
        self._pending = 0
        self._running = False
        self._kicked = False  # pragma: no mutate (equivalent: _watch clears it before it matters)
        self._kick_sent = False  # a wake-up from another thread is on its way to the loop
        self._scope: anyio.CancelScope | None = None
        # The task, strongly referenced: asyncio keeps only weak references to its tasks.
        self._task: object = None

    # ------------------------------------------------------------------ called by waiting tasks

    def add(self, entry: Entry) -> None:
        self._by_age.append(entry)
        self._pending += 1
        self._added(entry)
        if not self._running:
            self._running = True
            self._task = self._spawn(self._run)

    def discard(self, entry: Entry) -> None:
        """Forget a wait whose task was cancelled."""
        if entry.finished or entry.dead:
            return
        entry.dead = True  # a thread blocked on it returns when the work is done, unheeded
        self._pending -= 1
        self._discarded(entry)
        if not self._pending:
            self._kick()  # let the waiter see it has nothing left and exit

    def _added(self, entry: Entry) -> None:
        raise NotImplementedError

    def _discarded(self, entry: Entry) -> None:
        pass

    def completed(self, entry: Entry) -> None:
        """A target's work completed (or failed, or its backend closed); any thread."""
        if self.gone():  # nothing will run the waits: forget them, leaving nothing held
            self.forsake()
            return
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
        if threading.get_ident() == self._thread and self._running_here():
            self._kick()
        elif not self._kick_sent:
            # One wake-up in flight at a time, however many completions a watcher thread
            # reports: the loop clears the flag before its sweep, so a completion told after
            # the clear sends another, and one told before is swept.
            self._kick_sent = True
            self._soon_threadsafe(self._kicked_from_afar)

    def _kicked_from_afar(self) -> None:
        self._kick_sent = False
        self._kick()

    def _soon_threadsafe(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` in the loop's thread soon; from any thread."""
        try:
            self._call_soon_threadsafe(fn)
        except RuntimeError:  # the loop has closed, or trio's run ended
            if self.gone():
                self.forsake()

    def forsake(self) -> None:
        """The loop closed with waits pending (asyncio's ``loop.close()``), so none of their
        tasks will run again: forget every wait, as a cancellation would (any thread; the
        loop's own runs no more). Their targets are released, ``pending_waits()`` lists
        them no more, and the waiter leaves the registry."""
        entries, self._by_age = self._by_age, deque()
        for entry in entries:
            if not (entry.dead or entry.finished):
                # the waiter has left the registry: a discard would change counts nobody reads
                entry.dead = True  # pragma: no mutate (equivalent: see above)
                entry.target.release()
                _diagnostics.unregister(entry)
        self._pending = 0  # pragma: no mutate (equivalent: the loop is closed: nothing reads it)
        self._abandoned()
        if self._registry.get(self._key) is self:
            del self._registry[self._key]

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
        watched = [e for e in ages if not (e.finished or e.dead or e.warned)]
        self._by_age = deque(watched)
        if not watched:
            return None
        now = _loop_time()
        _diagnostics.warn_late([e for e in watched if now - e.since >= threshold])
        pending = [e.since for e in watched if not e.warned]
        return min(pending) + threshold - now if pending else None

    def _finish(self, entry: Entry, error: BaseException | None) -> None:
        entry.finished = True
        entry.error = error
        self._pending -= 1
        parked = entry.parked
        if self.on_trio:
            parked.set()
        elif not parked.done():  # else cancelled: its task is on its way out
            parked.set_result(None)

    def _check(self, entry: Entry) -> bool:
        """Check one wait; finish it if its work completed or failed. Return whether it did."""
        try:
            done = entry.target.done()
        except AiostreamError as exc:  # the device failed, or the backend was reset
            # raised again in the waiting task, from there: the frames of this look (which
            # hold the waiter) are not the user's, and a kept error must not keep them
            self._finish(entry, exc.with_traceback(None))
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
            delay = self._sweep()
            if not self._pending:
                return
            due = self._watchdog()
            if due is not None:
                delay = due if delay is None else min(delay, due)
            if self._kicked:
                continue
            if delay == 0.0:  # a look on the loop's next turn: no timer, no scope to cancel
                # the CPU to any thread ready to run (the driver's, the watcher's) first: a
                # spinning loop must not hold up the completion it waits for
                _yield_cpu()
                await anyio.lowlevel.checkpoint()
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


class TimedWaiter(Waiter):
    """For backends that know when work completes (the virtual one).

    Each wait asks its target to be told of the completion (``WaitTarget.watch``); the
    backend tells it from whichever thread processes the completion, and the waiter finishes
    just those waits. Between wakes it sleeps until the backend's next completion
    (``Backend.wake_hint``), or until kicked by a manual clock or by work that ends sooner.
    A wake costs O(1) per completed wait; pending waits are never visited.
    """

    def _added(self, entry: Entry) -> None:
        entry.target.watch(entry, self.gone)

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


class StrategyWaiter(Waiter):
    """For backends that cannot say when work will complete (CUDA): the backend tells of
    completions (``watch``) as it learns them, and the loop also looks at the waits whose
    strategy says so (``quiet`` and ``hybrid`` for its check budget, ``poll``).

    Waits on one stream (a *lane*) complete in order, so the loop looks only at the head of
    each lane, each lane on its own schedule (every loop turn for the check budget, then, for
    ``poll``, every half of the head's age, at least ``TIMER_FLOOR_S``, up to ``POLL_CAP_S``),
    kept in a heap: a wake visits only the lanes that are due, and a new wait costs O(log n)
    however many are pending. The backend's word (``watch``) reaches the loop in one hop: the
    callback it sends finishes the told waits itself, without waking the waiter's task.
    """

    def __init__(self, backend: AnyBackend, index: int, registry: dict[tuple[int, int], Waiter]):
        super().__init__(backend, index, registry)
        self._lanes: dict[Hashable, list[tuple[int, int, Entry]]] = {}  # polled entries
        self._order = itertools.count()
        self._dead = 0
        self._due_at: dict[Hashable, float] = {}  # each polled lane's next look (loop time)
        self._schedule: list[tuple[float, int, Hashable]] = []  # the same, as a heap
        self._spinning: set[Hashable] = set()  # the lanes looked at on every turn
        #: quiet and hybrid waits handed over, to be looked at again near their predicted
        #: end: (loop time of the next look, order, entry, clock time of the end, and of the
        #: last look)
        self._near: list[tuple[float, int, Entry, float, float]] = []
        self._near_spin: list[tuple[float, Entry]] = []  # those looked at on every turn
        try:
            lengths = _typical.get()
        except LookupError:
            lengths = {}
            _typical.set(lengths)
        mine = lengths.get(self._key)
        if mine is None:
            mine = lengths[self._key] = Lengths()
        self._lengths = mine

    @property
    def typical(self) -> float | None:
        """The typical length of the device's recent waits on this loop (s): a moving
        average, None before the first."""
        return self._lengths.typical if self._lengths.count else None

    def budget(self) -> float:
        """The check budget of a wait (s): how long the loop looks at it on each of its
        turns before the backend alone watches it (``quiet``, ``hybrid``) or it sleeps
        between looks (``poll``)."""
        typical = self.typical
        if typical is None:
            return SPIN_MAX_S
        if typical > SPIN_MAX_S:
            return SPIN_MIN_S  # recent waits were long: a look or two, then the watcher
        return min(SPIN_MAX_S, 1.5 * typical + SPIN_MIN_S)

    def _finish(self, entry: Entry, error: BaseException | None) -> None:
        super()._finish(entry, error)
        if error is None:
            self._lengths.add(_clock() - entry.started)

    def _added(self, entry: Entry) -> None:
        if entry.strategy in ("thread", "callback"):
            entry.target.watch(entry, self.gone)  # the watcher's from the start
            return
        lane = entry.target.lane
        heap = self._lanes.get(lane)
        if heap is None:
            if entry.strategy in _HANDED and len(self._spinning) >= SPIN_LANES:
                entry.target.watch(entry, self.gone)  # enough streams are looked at on every turn
                return
            heap = self._lanes[lane] = []
        heapq.heappush(heap, (entry.target.seq, next(self._order), entry))
        if heap[0][2] is entry:  # a new head: look at it on the next turn
            self._plan(lane, entry.since)
            self._kick()

    def _plan(self, lane: Hashable, at: float) -> None:
        if self._due_at.get(lane, math.inf) > at:
            self._due_at[lane] = at
            heapq.heappush(self._schedule, (at, next(self._order), lane))

    def _discarded(self, entry: Entry) -> None:
        self._dead += 1
        # compacting sooner or later drops only settled waits
        if self._dead >= _COMPACT_MIN and self._dead > self._pending:  # pragma: no mutate
            self._compact()

    def _compact(self) -> None:
        for lane, heap in list(self._lanes.items()):
            live = [item for item in heap if not (item[2].dead or item[2].finished)]
            if live:
                heapq.heapify(live)
                self._lanes[lane] = live
            else:
                del self._lanes[lane]
                self._spinning.discard(lane)
        self._dead = 0

    def _kicked_from_afar(self) -> None:
        """The backend's word, in the loop's thread: finish the told waits here and now (one
        hop from the watcher to the waiting task); the waiter's task is woken only to see
        that nothing is left."""
        self._kick_sent = False
        self._told()
        if not self._pending:
            self._kick()

    def _told(self) -> None:
        """Finish the waits the backend told of."""
        due = self._due
        while due:
            entry = due.popleft()
            if not (entry.dead or entry.finished or self._check(entry)):
                entry.target.watch(entry, self.gone)  # neither done nor failed: to be told again

    def _sweep(self) -> float | None:
        now = _loop_time()
        self._told()
        schedule = self._schedule
        lanes = []  # the lanes due now, taken first: a lane planned again goes to a later turn
        while schedule and schedule[0][0] <= now:
            at, _, lane = heapq.heappop(schedule)
            if self._due_at.get(lane) == at:  # else planned again since: a later entry stands
                del self._due_at[lane]
                lanes.append(lane)
        if lanes:
            clock, budget = _clock(), self.budget()
            for lane in lanes:
                next_look = self._sweep_lane(lane, now, clock, budget)
                if next_look is not None:
                    self._plan(lane, next_look)
        if self._near or self._near_spin:
            self._near_looks(now)
        # a wait handed over above may have been told at once, from this very sweep (its
        # work completed since the look before): no kick comes for it
        self._told()
        if self._near_spin:
            return 0.0
        at = schedule[0][0] if schedule else math.inf
        if self._near:
            at = min(at, self._near[0][0])
        if at == math.inf:
            return None  # until the backend tells, or a new wait comes
        delay = at - now
        # never a timer shorter than the loop honours: it would sleep its floor anyway
        return 0.0 if delay <= 0.0 else max(delay, TIMER_FLOOR_S)

    def _sweep_lane(self, lane: Hashable, now: float, clock: float, budget: float) -> float | None:
        """Finish the lane's completed waits in order, and hand quiet's and hybrid's over to the
        backend once past their check budget; return when to look at the lane again (loop time), or
        None."""
        heap = self._lanes.get(lane)
        spinning = self._spinning
        while heap:
            entry = heap[0][2]
            if entry.dead:
                heapq.heappop(heap)
                self._dead -= 1
                continue
            if entry.finished:
                heapq.heappop(heap)
                continue
            age = clock - entry.started
            spin = age < budget and (lane in spinning or len(spinning) < SPIN_LANES)
            if spin:
                seen = entry.target.peek()  # the flag the device writes: no driver call
                if seen is None:  # the backend tells only through the driver: ask it
                    seen = True
                if seen and self._check(entry):
                    heapq.heappop(heap)
                    continue
            if spin:
                spinning.add(lane)
                return now  # the next turn
            spinning.discard(lane)
            if entry.strategy in _HANDED:
                heapq.heappop(heap)
                entry.target.watch(entry, self.gone)  # the backend has it from here
                self._plan_near(entry, now, clock)
                continue
            if self._check(entry):  # poll, past its budget: done() tells a failed device too
                heapq.heappop(heap)
                continue
            return now + min(POLL_CAP_S, max(TIMER_FLOOR_S, age / 2))
        self._lanes.pop(lane, None)
        spinning.discard(lane)
        return None

    def _plan_near(self, entry: Entry, now: float, clock: float) -> None:
        """Plan the near-end look of a wait just handed over, if its end can be
        predicted: sleeps of whole milliseconds (the loop's timer wakes it no later), at most
        ``NEAR_STEP_S`` each, to ``NEAR_LEAD_S`` before the end, then a look on every turn
        until a little after it."""
        predicted = self._lengths.predicted()
        if predicted is None or entry.finished:
            return
        end = entry.started + predicted
        until = end + max(NEAR_LEAD_S, 2 * self._lengths.spread)
        if until <= clock:
            return  # it ran past its prediction already: the backend's word is as prompt
        self._near_step(entry, now, clock, end, until)

    def _near_step(self, entry: Entry, now: float, clock: float, end: float, until: float) -> None:
        """The next near-end look at ``entry``: on the next turn once within ``NEAR_LEAD_S``
        and a timer's floor of ``end``, else after a sleep of whole milliseconds (a long one
        is taken in steps: a loop's timer may wake a millisecond late after a long sleep)."""
        ahead = end - NEAR_LEAD_S - clock
        if ahead < TIMER_FLOOR_S:
            at = now
        else:
            at = now + TIMER_FLOOR_S * math.floor(min(ahead, NEAR_STEP_S) / TIMER_FLOOR_S)
        heapq.heappush(self._near, (at, next(self._order), entry, end, until))

    def _near_looks(self, now: float) -> None:
        """Look at the handed-over waits near their predicted end: finish those done, keep
        those still within their window on every turn (at most ``SPIN_LANES``)."""
        near, spin = self._near, self._near_spin
        clock = _clock()
        while near and near[0][0] <= now:
            _, _, entry, end, until = heapq.heappop(near)
            if entry.dead or entry.finished:
                continue
            if end - NEAR_LEAD_S - clock >= TIMER_FLOOR_S:  # not near yet: another step
                self._near_step(entry, now, clock, end, until)
            elif len(spin) < SPIN_LANES:
                spin.append((until, entry))
        if not spin:
            return
        keep = []
        for until, entry in spin:
            if entry.dead or entry.finished:
                continue
            seen = entry.target.peek()  # the flag: no driver call
            if seen and self._check(entry):
                continue
            if seen is not None and clock < until:
                keep.append((until, entry))
        self._near_spin = keep

    def _abandoned(self) -> None:
        self._near.clear()
        self._near_spin.clear()
        self._lanes.clear()
        self._due_at.clear()
        self._schedule.clear()
        self._spinning.clear()
        self._dead = 0  # pragma: no mutate (equivalent: its waits are settled: none is discarded)


def waiter_for(backend: AnyBackend, index: int) -> Waiter:
    """The waiter of ``backend``'s device ``index`` on the running loop (made if none runs)."""
    try:
        registry = _registry.get()
    except LookupError:
        registry = {}
        _registry.set(registry)
    waiter = registry.get((id(backend), index))
    if waiter is None or waiter.backend is not backend:
        kind = TimedWaiter if backend.completion_times else StrategyWaiter
        waiter = registry[(id(backend), index)] = kind(backend, index, registry)
    return waiter
