"""How the CUDA backend learns that awaited work completed: completion flags the device writes,
and one watching thread per device.

A *mark* is a point on a stream the device tells of: a fresh 32-bit value written into a
*slot* of pinned, device-mapped memory with ``cuStreamWriteValue32`` right after the work
before it, a stream memory operation done by the device with no round trip to the host and
nothing added to the stream but the write. A stream's capture puts a mark on the stream; every
record of an aiostream event puts one right after the record, so a wait on the event reads
that mark however much work was submitted after it. Whether the work has completed is then one
memory read (``flags[slot] == value``), and one vectorised comparison over all slots finds
every completed mark at once, whatever their number: no driver call, no event per wait, no
thread or stream per wait.

The device's :class:`Watcher` thread sleeps on a semaphore. It is woken by a host function,
libc's ``sem_post`` (a C function: no Python ever runs on the driver's thread), enqueued next
to the write for waits that asked to be told promptly (see :meth:`Watcher.mark`); and by its
own timer, with a back-off, for the waits that did not (a host function holds up later work on
its stream until it has run) and for events it has to query. It then tells the waiting loops,
through the callback each gave to :meth:`Target.watch`, as the virtual backend does. Every 50 ms
while waits are watched it also asks the device whether it has failed: host functions never
run after a fault.

A host function that announces a mark when it is made (``Watcher.mark`` with ``wake``) comes
right *before* it, so that the mark stands for the stream's whole work at that point, the host
function included: a stream told complete is then idle for ``cuStreamQuery`` too, where a host
function still queued after the mark would keep it busy. Such a mark lands just after the host
function posts the watcher, which therefore keeps polling for a while after a post
(``CHASE_S``).

A slot is free again once its value has landed: a sweep frees it, or the wait that reads it,
and every slot in use is swept before another chunk is made, so the flag memory grows with the
marks not yet reached, not with the events alive. A mark whose waits were all
cancelled before that leaves the slot *draining* until the device writes it (a hung kernel
holds 4 bytes, never a thread or an event). Slots come in chunks of pinned memory, made as
needed; chunks beyond the first are given back once nothing uses them. Values count up to
2**32 - 1 and start again at 1 (0 is fresh memory's), so they repeat: a slot is cleared as a
mark takes it, so that the value left there, landed long ago, never reads as the new mark's.

Waits on an event of another library (``as_event``), and every wait where the device cannot
write values (stream memory operations unsupported: marks are then internal marker events),
are queried with ``cuEventQuery`` instead: the same interface, at a driver call per wait and
poll.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from ..._errors import AiostreamError, CudaError, DeviceError
from .driver import NOT_SUPPORTED, SUCCESS, Driver
from .wakes import driver_launch_host_func, semaphores

__all__ = ["CLOSED", "Mark", "Target", "Watcher", "watcher_stats"]

logger = logging.getLogger("aiostream")

MEMHOSTALLOC_FLAGS = 0x1 | 0x2  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
CHUNK = 4096  #: slots per chunk of flag memory (16 KiB)
HEALTH_S = 0.05  #: while waits are watched, how often the device is asked whether it failed
POLL_MIN_S = 50e-6  #: the watcher's first polls of waits no host function will announce
POLL_CAP_S = 2e-3  #: and its longest interval between them while waits are young
#: past that, the interval is this share of the time nothing completed or began (a wait is
#: late by at most that share of its age, unless wake-ups are dear: ``POLL_CPU``): a wake-up
#: costs the watcher tens of microseconds, so long waits are looked at seldom
POLL_SHARE = 0.01
POLL_MAX_S = 0.01  #: and at most this (unless wake-ups are dear: up to ``HEALTH_S``)
#: once nothing has completed for ``YOUNG_S``, the watcher keeps its polls under this share of a
#: core where a wake-up is dear (100-300 us of CPU measured on a 2-core virtual machine, where
#: a thread's timed sleep alone costs 30-100 us): the interval is at least the CPU of its
#: recent wake-ups over this share, but no more than ``POLL_LATE`` of the quiet time (nor
#: ``HEALTH_S``); where wake-ups are cheap this is below the back-off and changes nothing
POLL_CPU = 0.005
POLL_LATE = 0.1
YOUNG_S = 0.1
#: after a sweep that found completed waits, the next poll is at least this far off (unless a
#: new wait comes, or a host function announces a mark): the completions of a burst are told
#: in batches, a wake-up and a hop to each loop per batch, no later than the loops' own timers
#: would be (their resolution is 1 ms)
POLL_BATCH_S = 1e-3
#: after the watcher is posted while a mark announced ahead is watched, how long it polls
#: (with the same back-off) for the mark, which lands once the host function has returned
CHASE_S = 0.02
FEW = 32  #: a sweep after a host function reads the watched marks alone up to this many
DRAIN_S = 0.25  #: with nothing watched, how often slots of cancelled waits are looked at
EVENT_DISABLE_TIMING = 0x2

#: what every use of the backend, and every wait pending then, says once it closed (at exit,
#: after the program's atexit handlers registered later than aiostream's first use)
CLOSED = (
    "the CUDA backend was closed (the interpreter is exiting): its streams, events and "
    "buffers can no longer be used; finish GPU work before the exit (an atexit handler "
    "registered before aiostream's first use runs after it closed)"
)


# ---------------------------------------------------------------------- marks and waits


class Mark:
    """A point on a stream the device tells of: it writes ``value`` into ``slot`` once the work
    before the point has completed; or, where the device writes no values, a marker ``event``
    recorded there."""

    __slots__ = ("ahead", "complete", "event", "first", "holders", "slot", "value", "woken")

    def __init__(self) -> None:
        self.slot = -1
        self.value = 0
        self.event: Any = None
        self.complete = False
        self.woken = False  # a host function next to it wakes the watcher
        self.ahead = False  # that host function comes before it: the mark lands after it ran
        self.holders = 1  # its maker; then the waits on it, and the event record it stands for
        #: the watched waits on it, linked through ``Target.next`` (most marks have one or
        #: none: no list per mark)
        self.first: Target | None = None

    def watched(self) -> list[Target]:
        """The watched waits on it."""
        out = []
        target = self.first
        while target is not None:
            out.append(target)
            target = target.next
        return out

    def unlink(self, target: Target) -> bool:
        """Take ``target`` off its watched waits; whether it was there."""
        if self.first is target:
            self.first = target.next
            target.next = None
            return True
        prev = self.first
        while prev is not None:
            if prev.next is target:
                prev.next = target.next
                target.next = None
                return True
            prev = prev.next
        return False


class Target:
    """One wait: on a mark, or (an event of another library, or no stream memory operations)
    on an event the watcher queries."""

    __slots__ = (
        "at",
        "callback",
        "complete",
        "error",
        "event",
        "gone",
        "lane",
        "mark",
        "next",
        "polled",
        "released",
        "seq",
        "stream",
        "watcher",
    )

    def __init__(self, watcher: Watcher, lane: Hashable, seq: int) -> None:
        self.watcher = watcher
        self.lane = lane
        self.seq = seq
        self.mark: Mark | None = None
        self.event: Any = None  # the event queried, when there is no mark
        self.polled = True  # watched, with no host function to announce it: polled
        self.complete = False
        self.released = False
        #: the error the watcher's query of it met (its wait raises it)
        self.error: DeviceError | None = None
        self.callback: Callable[[], None] | None = None
        self.gone: Callable[[], bool] | None = None  # its loop's (WaitTarget.watch)
        #: the private stream whose host function is to announce the mark once the wait is
        #: watched (``Watcher.announce``), if nothing of the user's followed its ``at``-th
        #: operation; None: polled
        self.stream: Any = None
        self.at = 0
        self.next: Target | None = None  # the next watched wait on its mark

    def done(self) -> bool:
        """Whether the captured work completed; raise ``CudaError`` if the device failed."""
        if self.complete:
            return True
        if self.error is not None:
            raise self.error
        watcher = self.watcher
        mark = self.mark
        if mark is not None:
            if watcher.reached(mark):
                self.complete = True
                return True
        elif self.event is not None and watcher.query(self.event):
            self.complete = True
            return True
        watcher.check()
        return False

    def peek(self) -> bool | None:
        """Whether the mark has landed: one read of its flag, no driver call (None: a wait on
        an event, which only ``cuEventQuery`` can answer). The mark is this wait's own, held
        until it is released, so a re-record of the event does not move it."""
        if self.complete:
            return True
        mark = self.mark
        if mark is None or (mark.slot < 0 and not mark.complete):
            return None  # an event, or a marker event: a driver call would tell
        if self.watcher.reached(mark):  # one flag read (lock held), no driver call
            self.complete = True
            return True
        return False

    def watch(self, callback: Callable[[], None], gone: Callable[[], bool] | None = None) -> None:
        """Call ``callback`` once, from the watcher's thread, when the work completes or the
        device fails, or once ``gone()`` says its loop closed; :meth:`release` cancels it."""
        self.watcher.watch(self, callback, gone)

    def release(self) -> None:
        """Forget the wait: no thread, event or stream stays held (a slot whose value has not
        landed drains until it does)."""
        self.watcher.release(self)


class _Chunk:
    """``CHUNK`` slots of pinned, device-mapped memory, and the mark each is waiting for."""

    __slots__ = ("dptr", "expected", "flags", "free", "owners", "ptr", "used")

    def __init__(self, ptr: int, dptr: int) -> None:
        self.ptr = ptr
        self.dptr = dptr
        memory = memoryview((ctypes.c_uint32 * CHUNK).from_address(ptr)).cast("B")
        self.flags = np.frombuffer(memory, dtype=np.uint32)
        self.flags[:] = 0
        # what each slot waits for; a free slot, which nothing writes, expects what it does
        # not hold, so that one comparison finds the landed values
        self.expected = np.ones_like(self.flags)
        self.owners: list[Mark | None] = [None] * CHUNK
        self.free = list(range(CHUNK - 1, -1, -1))
        self.used = 0


class Flags:
    """A device's completion flags: slots in chunks of pinned, device-mapped memory (the
    backend's lock held for every call)."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.drv: Driver = dev.drv
        self.index: int = dev.index
        self.chunks: list[_Chunk] = []
        self.values = 0

    def take(self, mark: Mark) -> int:
        """A free slot for ``mark`` (its slot and value set): the device address to write."""
        i = next((i for i, c in enumerate(self.chunks) if c.free), len(self.chunks))
        chunk = self.chunks[i] if i < len(self.chunks) else self._new_chunk()
        j = chunk.free.pop()
        chunk.used += 1
        self.values = self.values % 0xFFFFFFFF + 1  # never 0, the value of fresh memory
        # values repeat once they wrap, and a free slot holds the last one written there
        # (landed: nothing writes it any more): cleared, it cannot read as this mark's
        chunk.flags[j] = 0
        chunk.expected[j] = self.values
        chunk.owners[j] = mark
        mark.slot, mark.value = i * CHUNK + j, self.values
        return chunk.dptr + 4 * j

    def _new_chunk(self) -> _Chunk:
        drv, cu = self.drv, self.drv.cu
        with self.dev.pushed:
            ptr = drv.check(
                cu.cuMemHostAlloc(CHUNK * 4, MEMHOSTALLOC_FLAGS), self.index, "cuMemHostAlloc"
            )
            result = cu.cuMemHostGetDevicePointer(ptr, 0)
            if result[0] != SUCCESS:
                cu.cuMemFreeHost(ptr)
                raise drv.error(result[0], self.index, "cuMemHostGetDevicePointer")
        chunk = _Chunk(int(ptr), int(result[1]))
        self.chunks.append(chunk)
        return chunk

    def free(self, mark: Mark) -> None:
        slot, mark.slot = mark.slot, -1
        chunk, j = self.chunks[slot // CHUNK], slot % CHUNK
        chunk.expected[j] = chunk.flags[j] ^ 1  # nothing writes it now: it never matches
        chunk.owners[j] = None
        chunk.free.append(j)
        chunk.used -= 1

    def landed(self, mark: Mark) -> bool:
        slot = mark.slot
        return bool(self.chunks[slot // CHUNK].flags[slot % CHUNK] == mark.value)

    def sweep(self, targets: Iterable[Target] | None = None) -> list[Mark]:
        """Free every slot whose value landed, or only those of the ``targets``' marks (a
        read of each, where a vectorised comparison of every slot would cost more); return
        their marks, now complete."""
        done: list[Mark] = []
        if targets is not None:
            for target in targets:
                mark = target.mark
                if mark is not None and mark.slot >= 0 and self.landed(mark):
                    mark.complete = True
                    self.free(mark)
                    done.append(mark)
            return done
        for chunk in self.chunks:
            if not chunk.used:
                continue
            hits = np.flatnonzero(chunk.flags == chunk.expected)
            for j in hits.tolist():
                mark = chunk.owners[j]
                if mark is not None:
                    mark.complete = True
                    self.free(mark)
                    done.append(mark)
        while len(self.chunks) > 1 and not self.chunks[-1].used:  # shrink when idle
            self.dev.release(self.drv.cu.cuMemFreeHost, self.chunks.pop().ptr)
        return done

    def full(self) -> bool:
        """Whether every slot of every chunk is taken."""
        return all(not c.free for c in self.chunks)

    def used(self) -> int:
        """Slots in use or draining."""
        return sum(c.used for c in self.chunks)

    def close(self) -> None:
        """Free the chunks whose values have all landed; the rest, which pending work will
        still write, are left to the context's release at exit."""
        for chunk in self.chunks:
            if not chunk.used:
                self.dev.release(self.drv.cu.cuMemFreeHost, chunk.ptr)
        self.chunks.clear()


class Health:
    """Whether a device failed: an event never recorded, queried (after a fault every call
    says so, its creation too) at most once a millisecond, its answer kept that long
    (backend's lock held)."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.event: Any = None  # made on first use
        self.failed: CudaError | None = None
        self.checked_at = float("-inf")  # when the driver was last asked (never)

    def check(self) -> None:
        """Raise the device's error if it failed. Its answer is kept, whichever call gave it:
        after a fault the event's creation fails too (every call returns the sticky error),
        and a check within the millisecond must not say the device is fine (the watcher tells
        a wait of the fault, whose own check then raises it, or the wait is watched again
        and told the same, forever)."""
        now = time.monotonic()
        if now - self.checked_at >= 1e-3:
            drv, index = self.dev.drv, self.dev.index
            with self.dev.pushed:
                call = "cuEventQuery"
                if self.event is None:
                    call = "cuEventCreate"
                    err, event = drv.cu.cuEventCreate(EVENT_DISABLE_TIMING)
                    if err == SUCCESS:
                        self.event, call = event, "cuEventQuery"
                if self.event is not None:
                    (err,) = drv.cu.cuEventQuery(self.event)
            self.failed = drv.failure(err, index, call)
            self.checked_at = now  # an answer, kept (a push that raised gave none)
        if self.failed is not None:
            raise self.failed

    def close(self) -> None:
        if self.event is not None:
            self.dev.release(self.dev.drv.cu.cuEventDestroy, self.event)
            self.event = None


class Owners:
    """The ``gone`` functions of the watched waits (``WaitTarget.watch``), one per waiting
    event loop, each with its number of waits."""

    def __init__(self) -> None:
        self.counts: dict[Callable[[], bool], int] = {}

    def add(self, gone: Callable[[], bool] | None) -> Callable[[], bool] | None:
        """Count a wait of ``gone``'s loop; return ``gone``."""
        if gone is not None:
            self.counts[gone] = self.counts.get(gone, 0) + 1
        return gone

    def remove(self, gone: Callable[[], bool] | None) -> None:
        if gone is not None:
            left = self.counts.pop(gone) - 1
            if left:
                self.counts[gone] = left

    def gone(self) -> list[Callable[[], bool]]:
        """The owners whose loop has closed."""
        return [gone for gone in self.counts if gone()]


class Watcher:
    """A device's marks, the waits being watched, and the thread that watches them.

    Its state is guarded by the backend's lock (``dev.lock``); the thread takes it for each
    sweep, and calls back with it released.
    """

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.index: int = dev.index
        self.drv: Driver = dev.drv
        self.lock: threading.RLock = dev.lock
        self.flags = Flags(dev)
        self.memops = True  # the device writes values (cuStreamWriteValue32); else markers
        # nothing to post where libc has no semaphores: no host function either
        self.launch = driver_launch_host_func(dev.drv.cu) if semaphores is not None else None
        self.watched: dict[Target, None] = {}
        self.polled = 0  # watched waits that no host function will announce
        self.ahead = 0  # watched waits on a mark announced ahead of it (see mark())
        self.chase_until = 0.0  # poll promptly until then: a host function ran (see _run)
        self.queried: dict[Target, None] = {}  # watched waits on an event
        self.owners = Owners()  # the watched waits' loops
        self.health = Health(dev)
        self.closed = False
        self.progress_at = time.monotonic()  # pragma: no mutate (equivalent: written before read)
        self.sleeping_until = float("inf")
        self.wake_cpu = 0.0  # the CPU of the thread's recent empty wake-ups (a moving average)
        self.batch_until = 0.0  # no poll before then: a sweep found completions (_sweep)
        self.sem = semaphores.new() if semaphores is not None else 0
        self.later: list[Callable[[], None]] = []  # callbacks found by a sweep off the thread
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ marks

    def mark(self, stream: Any, wake: bool) -> Mark:
        """A mark after the work submitted to ``stream`` so far (lock held), held once; with
        ``wake``, a host function right before it, which announces it (module docstring)."""
        drv, cu = self.drv, self.drv.cu
        mark = Mark()
        if wake:
            self.wake(mark, stream)
            mark.ahead = mark.woken
        with self.dev.pushed.around(stream):
            if self.memops:
                if self.flags.full():
                    self.collect()  # landed slots still held by recorded events come back
                address = self.flags.take(mark)
                (err,) = cu.cuStreamWriteValue32(stream, address, mark.value, 0)
                if err == NOT_SUPPORTED:
                    logger.debug("cuda:%d: no cuStreamWriteValue32: events mark waits", self.index)
                    self.memops = False
                if err != SUCCESS:
                    self.flags.free(mark)
                    if err != NOT_SUPPORTED:
                        raise drv.error(err, self.index, "cuStreamWriteValue32")
            if not self.memops:
                marker = self.dev.marker()
                (err,) = cu.cuEventRecord(marker, stream)
                if err != SUCCESS:
                    self.dev.give_back(marker)
                    raise drv.error(err, self.index, "cuEventRecord")
                mark.event = marker
        return mark

    def wake(self, mark: Mark, stream: Any) -> None:
        """A host function (``sem_post``) on ``stream`` to announce ``mark``: the stream's
        work so far must end at the mark, or (``mark()``) right before it (lock held)."""
        if mark.woken or self.launch is None or semaphores is None:
            return
        with self.dev.pushed.around(stream):
            code = self.launch(int(stream), semaphores.post_address, self.sem)
        if code != SUCCESS:
            raise self.drv.error(self.drv.cu.CUresult(code), self.index, "cuLaunchHostFunc")
        mark.woken = True

    def announce(self, target: Target) -> None:
        """Launch the host function after ``target``'s mark, which announces it, as its wait
        is watched (lock held): unless one is there already, or the user's work followed the
        mark on its stream since (a host function then would wait for that work too)."""
        stream, mark = target.stream, target.mark
        if mark is None or mark.woken or not stream.alive or not stream.private:
            return
        if stream.ops != target.at:
            return
        self.wake(mark, stream.ptr)
        if mark.woken:
            stream.woke, stream.woke_at = mark, target.at

    def unhold(self, mark: Mark) -> None:
        """One holder less (lock held); with none left, its slot is freed (or drains)."""
        mark.holders -= 1
        if mark.holders:
            return
        if self.closed:  # its flags went with the close (a finalizer run after it)
            mark.slot = -1
        if mark.slot >= 0 and self.flags.landed(mark):
            mark.complete = True
            self.flags.free(mark)
        elif mark.slot >= 0:  # it drains: a sweep must come to free it
            self._start()
            if self.sleeping_until == float("inf") and semaphores is not None:
                semaphores.post(self.sem)
                self.sleeping_until = 0.0  # it wakes now: later calls need not post again
        if mark.event is not None:
            self.dev.give_back(mark.event)
            mark.event = None

    def reached(self, mark: Mark) -> bool:
        """Whether the work before ``mark`` completed (raise if the device failed). A landed
        slot that no watched wait needs is freed at once."""
        if mark.complete:
            return True
        if mark.slot >= 0:
            with self.lock:  # (closed: its flags went with the close; check() says so)
                if mark.slot >= 0 and not self.closed and self.flags.landed(mark):
                    mark.complete = True
                    if mark.first is None:  # else the sweep frees it, and tells them
                        self.flags.free(mark)
        elif mark.event is not None:
            mark.complete = self.query(mark.event)
        return mark.complete

    # ------------------------------------------------------------------ checks

    def query(self, event: Any) -> bool:
        """Whether ``event`` completed (``cuEventQuery``); raise if the device failed, or if
        the backend closed (which destroyed the event: not while it is queried)."""
        with self.lock:
            if self.closed:
                raise AiostreamError(CLOSED)
            with self.dev.pushed:
                (err,) = self.drv.cu.cuEventQuery(event)
        return self.drv.ready(err, self.index, "cuEventQuery")

    def check(self) -> None:
        """Raise the device's error if it failed (``Health``), or if the backend was closed."""
        with self.lock:
            if self.closed:
                raise AiostreamError(CLOSED)
            self.health.check()

    # ------------------------------------------------------------------ watching

    def watch(
        self, target: Target, callback: Callable[[], None], gone: Callable[[], bool] | None
    ) -> None:
        with self.lock:
            if target.released or target.callback is not None:
                return
            mark = target.mark
            tell_now = target.complete or self.closed or (mark is not None and mark.complete)
            if not tell_now and target.stream is not None:
                try:
                    self.announce(target)
                except CudaError:  # polled instead; the health check tells a failed device
                    logger.debug("cuda:%d: no host function for a wait", self.index)
                target.stream = None
            if not tell_now:  # (post is read only then)
                target.callback = callback
                self.watched[target] = None  # pragma: no mutate (equivalent: values unread)
                target.gone = self.owners.add(gone)
                if mark is not None and mark.slot >= 0:
                    target.next, mark.first = mark.first, target  # the sweep of flags tells it
                    target.polled = not mark.woken
                    self.ahead += mark.ahead
                else:
                    self.queried[target] = None  # the sweep queries it
                now = time.monotonic()
                if target.polled:
                    self.polled += 1
                    self.progress_at = now  # poll a new wait promptly, then back off
                    self.batch_until = 0.0
                self._start()
                # wake the thread if it sleeps past when this wait needs a look
                post = self.sleeping_until > now + (POLL_MIN_S if target.polled else HEALTH_S)
                if post:  # it wakes now and plans anew for every wait: the next need not post
                    self.sleeping_until = 0.0
        if tell_now:
            callback()
        elif post and semaphores is not None:
            semaphores.post(self.sem)

    def release(self, target: Target) -> None:
        if self.closed:  # nothing is held after the close: never wait for the lock then (at
            target.released = True  # exit a daemon thread may have frozen holding it)
            return
        with self.lock:
            if target.released:
                return
            target.released = True
            target.stream = None
            self._forget(target)
            if target.mark is not None:
                self.unhold(target.mark)
                target.mark = None  # pragma: no mutate (equivalent: never read again once released)
            target.event = None  # pragma: no mutate (equivalent: never read again once released)

    def _forget(self, target: Target) -> None:
        """Stop watching ``target`` (lock held)."""
        if target.callback is None:
            return
        target.callback = None
        self.watched.pop(target, None)
        self.queried.pop(target, None)
        self.owners.remove(target.gone)
        target.gone = None
        mark = target.mark
        if mark is not None and mark.unlink(target):
            self.ahead -= mark.ahead
        if target.polled:
            self.polled -= 1

    def _start(self) -> None:
        if self.thread is None and not self.closed:
            self.thread = threading.Thread(
                target=self._run, name=f"aiostream cuda:{self.index} watcher", daemon=True
            )
            self.thread.start()

    def _timeout(self, now: float) -> float | None:
        """How long the thread may sleep (lock held): until posted, if nothing is watched and
        no slot drains (a landed slot is freed by a later sweep)."""
        if not self.watched:
            return DRAIN_S if self.flags.used() else None
        timeout = HEALTH_S
        if self.polled or self.queried or now < self.chase_until:
            quiet = now - self.progress_at
            cap = max(POLL_CAP_S, min(POLL_MAX_S, quiet * POLL_SHARE))
            if quiet >= YOUNG_S:
                cap = max(cap, min(self.wake_cpu / POLL_CPU, quiet * POLL_LATE))
            timeout = min(timeout, max(POLL_MIN_S, min(cap, quiet / 4), self.batch_until - now))
        return timeout

    def _run(self) -> None:
        self.drv.own_thread()  # its queries never break another thread's capture
        with self.lock:
            if self.closed:
                return
            timeout = _plan_sleep(self)
        cpu, cost = time.thread_time(), None
        while True:
            posted = False
            if semaphores is not None:
                posted = semaphores.wait(self.sem, timeout)
            else:
                time.sleep(POLL_CAP_S if timeout is None else timeout)
            with self.lock:
                if self.closed:
                    return
                if cost is not None:  # the last wake-up's, measured after its callbacks
                    self.wake_cpu += (cost - self.wake_cpu) / 8
                due = self._sweep(few=posted)  # posted: the watched marks, not every slot
                if posted and self.ahead:  # maybe the host function before a watched mark
                    now = time.monotonic()
                    self.progress_at, self.chase_until = now, now + CHASE_S
                    self.batch_until = 0.0  # its mark lands any moment: look at once
                if self.later:
                    due += self.later
                    self.later = []
                # planned before the callbacks: the loops they wake need the GIL it holds
                timeout = _plan_sleep(self)
            _call(due)
            # what a wake-up that finds nothing costs, the sleep's entry and exit included
            cpu, spent = time.thread_time(), cpu
            cost = None if due else cpu - spent

    def _sweep(self, few: bool = False) -> list[Callable[[], None]]:
        """Find the waits whose work completed (lock held): their callbacks."""
        due: list[Callable[[], None]] = []
        # woken by a host function with few waits watched: a read of each of their marks
        for mark in self.flags.sweep(self.watched if few and len(self.watched) <= FEW else None):
            for target in mark.watched():
                self._fire(target, due)
        failed = False
        for target in list(self.queried):
            try:
                if target.done():
                    self._fire(target, due)
            except DeviceError as exc:  # kept for its wait: a query's error may not come again
                target.error = exc
                failed = True
            except AiostreamError:  # its own (a captured event's): its wait raises it
                self._fire(target, due)
        now = time.monotonic()
        if self.watched and now - self.health.checked_at >= HEALTH_S:
            gone = self.owners.gone()  # loops closed with waits pending: told, they forget them
            for target in [t for t in self.watched if t.gone in gone] if gone else []:
                self._fire(target, due)
            try:
                self.check()
            except AiostreamError:
                failed = True
        if failed:  # host functions never run after a fault: tell everyone (each raises it)
            for target in list(self.watched):
                self._fire(target, due)
        if due:  # more may come soon: the back-off halves (new waits restart it: watch()),
            # and after a long quiet the waits are young again (the first completion of a
            # burst would else leave the rest to the quiet's slow polls: 8 ms apart where a
            # wake-up costs 40 us)
            quiet = min((now - self.progress_at) / 2, YOUNG_S / 2)
            self.progress_at = now - quiet
            self.batch_until = now + POLL_BATCH_S
        return due

    def collect(self) -> None:
        """Sweep now, off the thread (lock held): free every landed slot, and leave the
        callbacks of the waits found complete to the thread."""
        due = self._sweep()
        if due:
            self.later.extend(due)
            self._start()
            if semaphores is not None:
                semaphores.post(self.sem)

    def _fire(self, target: Target, due: list[Callable[[], None]]) -> None:
        callback = target.callback
        self._forget(target)
        if callback is not None:
            due.append(callback)

    def close(self) -> None:
        """Stop the thread and tell every watched wait (lock held; at close). The flags are
        freed later, with the context (``Device.release_all``)."""
        due = self._sweep() if not self.closed else []
        due += self.later
        self.later = []
        self.closed = True
        for target in list(self.watched):
            self._fire(target, due)
        if semaphores is not None:
            semaphores.post(self.sem)
        _call(due)
        self.health.close()


def watcher_stats(watcher: Watcher) -> tuple[int, int, int]:
    """(waits watched, slots in use or draining, chunks of flag memory), after a sweep."""
    with watcher.lock:
        if not watcher.closed:
            watcher.collect()
        return len(watcher.watched), watcher.flags.used(), len(watcher.flags.chunks)


def _plan_sleep(watcher: Watcher) -> float | None:
    """How long ``watcher``'s thread sleeps next (lock held), noted in ``sleeping_until``."""
    now = time.monotonic()
    timeout = watcher._timeout(now)  # noqa: SLF001 (the thread's own plan, split off its class)
    watcher.sleeping_until = float("inf") if timeout is None else now + timeout
    return timeout


def _call(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # one waiter's failure must not stop the others' wake-ups
            logger.exception("aiostream: a wait's completion callback failed")
