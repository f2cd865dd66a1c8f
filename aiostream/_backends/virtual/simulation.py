"""The simulation's state and time: devices, the scheduler and one clock under one lock, and
the waits on its work.

Device time is kept in integer nanoseconds, read from one clock per backend (the monotonic
clock, a manual :class:`VirtualClock`, or any callable returning seconds), so that arithmetic on
it is exact and a program gives the same timeline on every run.

The simulation is lazy: nothing happens between calls. Every call first brings the scheduler
to the clock's "now" (:meth:`Simulation.now`), which processes the completions that came due in
time order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..._errors import AiostreamError, StaleHandleError
from .clock import Listeners, listen, resolve_clock
from .model import DONE, Device, Item, Stream
from .options import VirtualOptions
from .scheduler import Scheduler

__all__ = ["Simulation", "Target"]

_NEVER = float("inf")


class Target:
    """One wait's captured work: an item, and whoever watches for its completion."""

    __slots__ = ("callback", "item", "lane", "released", "seq", "sim")

    def __init__(self, sim: Simulation, item: Item) -> None:
        self.sim = sim
        self.item = item
        self.released = False
        self.callback: Callable[[], None] | None = None
        self.lane: object = item.stream
        self.seq = item.seq

    def done(self) -> bool:
        if self.sim.item_done(self.item):
            return True
        self.sim.check_moving(self.item)  # pending on a clock that stopped: it never will be
        return False

    def peek(self) -> bool | None:
        """None: the simulator tells its waits when their work completes (its waiter never
        polls them)."""
        return None

    def watch(self, callback: Callable[[], None], gone: Callable[[], bool] | None = None) -> None:
        """Call ``callback`` once, from any thread, when the work completes or fails or the
        backend closes; at once if it already has. (``gone`` is not needed: no thread of the
        simulator's keeps watching; whoever moves the simulation calls back.)"""
        self.sim.watch(self, callback)

    def __call__(self) -> None:  # the scheduler calls its watchers
        callback, self.callback = self.callback, None
        if callback is not None and not self.released:
            callback()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.callback = None  # pragma: no mutate (equivalent: a released target never calls it)
            self.sim.release(self)


class Simulation:
    """Devices, scheduler and clock, and the waits: what every part of the backend shares.

    ``lock`` (reentrant) guards it all; the methods named ``*_locked`` expect it held.
    """

    def __init__(self, options: VirtualOptions, clock: object) -> None:
        self.lock = threading.RLock()
        self.clock_ns, self.manual = resolve_clock(clock)
        # a clock may say why it stands still now (``_aiostream_stopped()``: a reason, or
        # None), as the pytest plugin's virtual_time clock does outside the test body: no
        # wait could end. A name of aiostream's own: a user's clock that happens to have a
        # ``stopped`` attribute is never taken for one
        self.stopped: Callable[[], str | None] | None = getattr(clock, "_aiostream_stopped", None)
        # ... and tells when it stops (the test body ended): the waits pending then wake and
        # raise the reason, as a wait begun then would
        on_stop = getattr(clock, "_aiostream_on_stop", None)
        if on_stop is not None:
            on_stop(self.wake_all)
        slots = options.slots()
        lead = options.lead_ns()
        self.devices = [Device(i, slots, lead) for i in range(options.devices)]
        self.sched = Scheduler(self.devices, self.clock_ns())
        self.closed = False
        self.listeners = Listeners()
        self._unlisten = listen(self.manual, self._advanced) if self.manual else None
        self._advancing = False  # the scheduler is moving (a host function may advance)
        self._hinted: float = _NEVER  # the earliest completion a waiter was told to sleep until
        self.targets: dict[Target, None] = {}

    def wake_all(self) -> None:
        """Wake every pending wait, to look again: the backend closed, or the clock stopped
        (each then raises why, from :meth:`Target.done`)."""
        with self.lock:
            targets = list(self.targets)
        for target in targets:
            target()
        self.listeners()

    def check_moving(self, item: Item) -> None:
        """Raise :class:`AiostreamError` when ``item`` is pending and the clock stands still
        (it would never complete)."""
        if self.stopped is not None and item.state != DONE and item.device.failure is None:
            why = self.stopped()
            if why is not None:  # a wait now would never end: say so rather than hang
                raise AiostreamError(why)

    def close(self) -> bool:
        """Retire the simulation and wake every pending wait; False if already closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            if self._unlisten is not None:
                self._unlisten()
        self.wake_all()  # pending waits wake up and see the error
        return True

    # ------------------------------------------------------------------ checks and time

    def check_open(self) -> None:
        if self.closed:
            raise StaleHandleError(
                "this object belongs to a virtual backend that aiostream.virtual.reset() "
                "replaced; create new streams and events after the reset"
            )

    def check_device(self, device: Device) -> None:
        self.check_open()
        if device.failure is not None:
            raise device.failure.error()

    def now_locked(self) -> int:
        """Bring the simulation to the clock's now and return it."""
        sched = self.sched
        now = self.clock_ns()
        # a clock must not run backwards; keep the timeline monotonic
        if now < sched.t:  # pragma: no mutate (equivalent: when equal, now keeps its value)
            now = sched.t
        if not self._advancing:  # a host function calling back in sees the instant it is at
            self._advancing = True
            try:
                sched.advance(now)
            finally:
                self._advancing = False
        return now

    def _advanced(self) -> None:
        """The manual clock moved: the device reaches what came due now, in the advancing
        thread (host functions run then, as on a device), and the waiters wake."""
        with self.lock:
            if not self.closed:
                self.now_locked()
        self.listeners()

    def sync_locked(self) -> None:
        """Bring the simulation to now, unless it is closed (for inspection)."""
        if not self.closed:
            self.now_locked()

    def settled(self) -> bool:
        """Lock-free: no completion has come due since the last sync (in doubt, False)."""
        running = self.sched.running
        try:
            return not running or running[0][0] > self.clock_ns()
        except IndexError:  # emptied by another thread meanwhile
            return False

    def item_done(self, item: Item) -> bool:
        device = item.device
        if item.state == DONE and device.failure is None and not self.closed and self.settled():
            return True
        with self.lock:
            self.check_open()
            self.now_locked()
            if device.failure is not None:
                raise device.failure.error()
            return item.state == DONE

    def submit_locked(
        self,
        stream: Stream,
        duration: int,
        engine: str | None,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> Item:
        """Submit on ``stream`` (device checked); wake waiters if it ends sooner than they
        sleep."""
        self.now_locked()
        item = self.sched.submit(stream, duration, engine, fn, error, name)
        if engine is not None:
            self.submitted_locked()
        return item

    def submitted_locked(self) -> None:
        """Operations were submitted: wake the waiters if one ends sooner than they sleep.

        A waiter sleeps until the completion it was told of (``wake_hint``), or until
        notified: work that ends sooner notifies, also when it was told that nothing runs
        (_NEVER; a stalled engine may hold everything, while new work runs on another). A
        manual clock notifies at each advance instead.
        """
        if self.manual is None:
            end = self.sched.next_end()
            if end is not None and end < self._hinted:
                self._hinted = end
                self.listeners()

    # ------------------------------------------------------------------ waits

    def target_locked(self, item: Item) -> Target:
        self.check_moving(item)
        target = Target(self, item)
        self.targets[target] = None
        return target

    def release(self, target: Target) -> None:
        with self.lock:
            del self.targets[target]  # made by target_locked; Target.release calls once
            watchers = target.item.watchers
            if watchers is not None and target in watchers:
                watchers.remove(target)

    def watch(self, target: Target, callback: Callable[[], None]) -> None:
        item = target.item
        with self.lock:
            if not (self.closed or item.state == DONE or item.device.failure is not None):
                target.callback = callback
                if item.watchers is None:
                    item.watchers = [target]
                else:
                    item.watchers.append(target)
                return
        callback()

    def wake_hint(self) -> float | None:
        with self.lock:
            if self.closed:
                return 0.0  # pragma: no mutate (equivalent: no waiter sleeps on it once closed)
            now = self.now_locked()
            end = self.sched.next_end()
            if self.manual is not None or end is None:
                self._hinted = _NEVER
                return None
            self._hinted = end
            return (end - now) / 1e9

    def wait_blocking(self, target: Target) -> None:
        """Block until ``target`` is done. Whoever completes it (this thread, an advance of
        the clock, another thread's call) wakes the waiter; it rechecks after every reading of
        the clock, since reading it may itself complete the work."""
        changed = threading.Event()
        unsubscribe = self.listeners.add(changed.set)
        try:
            target.watch(changed.set)
            while True:
                changed.clear()
                hint = self.wake_hint()
                if target.done():
                    return
                changed.wait(hint)
        finally:
            unsubscribe()
