"""The virtual backend: a deterministic simulated device.

Device time is kept in integer nanoseconds, read from one clock per backend (the monotonic clock,
a manual :class:`VirtualClock`, or any callable returning seconds), so that arithmetic on it is
exact and a program gives the same timeline on every run.

The simulation is lazy: nothing happens between calls. Every call brings it to the clock's "now"
by processing, in time order, the completions that have come due, and at each of them starting
what can start. An operation starts at the latest of its submission, the end of the previous
work on its stream, the events its stream waits on and a free slot of its engine; among
operations ready for one engine, the higher-priority stream goes first, then the one ready
first, then the one submitted first, and operations submitted at one instant go in stream
order. Starts made at an instant are decided again when more work is submitted at that same
instant, so the timeline is a function of what each stream received and when, not of the order
in which the event loop ran the tasks that submitted it.

Records and completions of the stream's frontier are zero-length *markers*: they take no engine
slot and complete when everything before them on their stream (and every event the stream waits
on) has completed, which gives events their timestamps.
"""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
import struct
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

from .._errors import AiostreamError, DeviceError, NotReadyError, StaleHandleError

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_D2D_BANDWIDTH",
    "DEFAULT_LATENCY",
    "ENGINES",
    "POISON",
    "PRIORITY_RANGE",
    "OpRecord",
    "VirtualBackend",
    "VirtualClock",
    "VirtualStats",
]

ENGINES = ("compute", "h2d", "d2h")
#: (lowest, highest) stream priority, as ``cuCtxGetStreamPriorityRange`` reports on recent GPUs.
PRIORITY_RANGE = (0, -5)
#: The byte value that fills a copy's destination from the copy's start until it completes.
POISON = 0xA5
#: Host-device link: near a PCIe 4.0 x16 link in practice (bytes per second, seconds).
_POISON_BYTE = bytes([POISON])
DEFAULT_BANDWIDTH = 25e9
DEFAULT_LATENCY = 10e-6
#: Device-to-device copies run on the compute engine at device-memory speed.
DEFAULT_D2D_BANDWIDTH = 1e12
_COPY_ENGINES = {"h2d": "h2d", "d2h": "d2h", "d2d": "compute"}
_IPC_MAGIC = b"aiostream:virt\x00\x01"  # 16 bytes
_IPC_SIZE = 64
_TIMELINE_LIMIT = 100_000

_PENDING, _RUNNING, _DONE = 0, 1, 2


def seconds_to_ns(value: object, name: str, *, allow_negative: bool = False) -> int:
    """Validate a duration in seconds and return it in integer nanoseconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds (int or float), got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0 and not allow_negative:
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    return round(value * 1_000_000_000)


class VirtualClock:
    """A manual clock for the virtual backend: device time moves only when advanced.

    Waits on a device driven by this clock resume when an :meth:`advance` passes the completion
    of their work. It may be advanced from any thread.

    Example:
        >>> clock = VirtualClock()
        >>> clock.advance(0.5)
        >>> clock.now()
        0.5
    """

    def __init__(self, start: float = 0.0) -> None:
        self._ns = seconds_to_ns(start, "start", allow_negative=True)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def now(self) -> float:
        """The clock's time in seconds."""
        return self._ns / 1e9

    def now_ns(self) -> int:
        """The clock's time in integer nanoseconds."""
        return self._ns

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (>= 0) and wake the waits that came due."""
        ns = seconds_to_ns(seconds, "seconds")
        with self._lock:
            self._ns += ns
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def _listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(callback)

        def unlisten() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return unlisten

    def __repr__(self) -> str:
        return f"VirtualClock(now={self.now()!r})"


@dataclass(frozen=True)
class VirtualStats:
    """What is alive on a virtual backend; all zero when a program leaked nothing."""

    streams: int
    """Streams created and not yet destroyed (default streams are not counted)."""
    events: int
    """Events created (at their first record) and not yet destroyed."""
    operations: int
    """Operations submitted and not yet completed."""
    waits: int
    """Waits (awaits and blocking waits) in progress."""
    buffers: int = 0
    """Host and device buffers allocated and not yet freed."""


@dataclass(frozen=True)
class OpRecord:
    """One completed operation of the timeline, times in device seconds."""

    name: str
    device: int
    stream: int
    engine: str
    submitted: float
    start: float
    end: float
    error: str | None


class _Failure:
    __slots__ = ("device", "message")

    def __init__(self, device: str, message: str) -> None:
        self.device = device
        self.message = message

    def error(self) -> DeviceError:
        # A fresh exception per raise: concurrent tasks must not share one traceback.
        return DeviceError(self.message, device=self.device)


class _Engine:
    __slots__ = ("busy", "name", "slots", "stalled")

    def __init__(self, name: str, slots: int) -> None:
        self.name = name
        self.slots = slots
        self.busy = 0
        self.stalled = False


class _Fault:
    """An injected fault: the next ``remaining`` matching operations fail or run slower."""

    __slots__ = ("engine", "factor", "message", "remaining", "stream")

    def __init__(
        self,
        stream: _Stream | None,
        engine: str | None,
        remaining: int,
        message: str | None,
        factor: float | None,
    ) -> None:
        self.stream = stream
        self.engine = engine
        self.remaining = remaining
        self.message = message
        self.factor = factor


class _Device:
    __slots__ = ("default", "engines", "failure", "faults", "index", "name", "stream_ids")

    def __init__(self, index: int, slots: dict[str, int]) -> None:
        self.index = index
        self.name = f"virtual:{index}"
        self.engines = {name: _Engine(name, n) for name, n in slots.items()}
        self.failure: _Failure | None = None
        self.faults: list[_Fault] = []
        self.stream_ids = itertools.count(1)
        self.default = _Stream(self, 0, 0, default=True)


class _Stream:
    __slots__ = ("default", "destroyed", "device", "id", "last", "priority", "queue", "waits")

    def __init__(self, device: _Device, sid: int, priority: int, *, default: bool = False):
        self.device = device
        self.id = sid
        self.priority = priority
        self.default = default
        self.destroyed = False
        self.queue: deque[_Item] = deque()  # submitted, not started yet
        self.last: _Item | None = None  # the last item submitted
        self.waits: list[_Item] = []  # event captures the next item waits for


class _Item:
    """An operation (``engine`` set) or a marker (``engine`` None)."""

    __slots__ = (
        "deps",
        "device",
        "duration",
        "end",
        "engine",
        "error",
        "fn",
        "name",
        "on_start",
        "ready",
        "seq",
        "start",
        "state",
        "stream",
        "submit",
    )

    def __init__(
        self,
        seq: int,
        stream: _Stream,
        deps: list[_Item],
        submit: int,
        duration: int,
        engine: str | None,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> None:
        self.seq = seq
        self.stream = stream
        self.device = stream.device
        self.deps = deps
        self.submit = submit
        self.duration = duration
        self.engine = engine
        self.fn = fn
        self.error = error
        self.name = name
        self.on_start: Callable[[], object] | None = None
        self.ready = -1
        self.start = -1
        self.end = -1
        self.state = _PENDING

    def order(self) -> tuple[int, int, int]:
        """Deterministic order among items at one instant: device, stream, submission."""
        return (self.device.index, self.stream.id, self.seq)


class _EventState:
    """What a recorded event captured; shared by every handle opened on one event (IPC)."""

    __slots__ = ("__weakref__", "id", "item", "timing")

    def __init__(self, eid: int, timing: bool) -> None:
        self.id = eid
        self.timing = timing
        self.item: _Item | None = None


class _Event:
    __slots__ = ("destroyed", "device", "interprocess", "state")

    def __init__(self, device: _Device, state: _EventState, interprocess: bool) -> None:
        self.device = device
        self.state = state
        self.interprocess = interprocess
        self.destroyed = False


class _Memory:
    """Host or device memory of the simulator: bytes, and the copies that will write them."""

    __slots__ = ("data", "device", "freed", "host", "inflight", "pinned", "writers")

    def __init__(self, nbytes: int, device: _Device, *, host: bool, pinned: bool) -> None:
        self.data = bytearray(nbytes)
        self.device = device
        self.host = host
        self.pinned = pinned
        self.freed = False
        self.inflight = 0  # copies into it submitted and not completed
        self.writers: list[_Item] = []


@dataclass(frozen=True)
class Race:
    """The host touched a buffer while a copy into it was in flight."""

    nbytes: int
    copy: str
    where: str

    def __str__(self) -> str:
        return f"host access to a {self.nbytes}-byte buffer while {self.copy} was in flight\n{self.where}"


class _Target:
    __slots__ = ("_backend", "_item", "_released", "lane", "seq")

    def __init__(self, backend: VirtualBackend, item: _Item) -> None:
        self._backend = backend
        self._item = item
        self._released = False
        self.lane: Hashable = item.stream
        self.seq = item.seq

    def done(self) -> bool:
        return self._backend._item_done(self._item)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._backend._release_wait(self)


def _resolve_clock(
    clock: object,
) -> tuple[Callable[[], int], VirtualClock | None]:
    if clock is None:
        return time.monotonic_ns, None
    if isinstance(clock, VirtualClock):
        return clock.now_ns, clock
    if callable(clock):
        read: Callable[[], float] = clock

        def now_ns() -> int:
            return round(read() * 1_000_000_000)

        return now_ns, None
    raise TypeError(
        "clock must be None (the monotonic clock), a VirtualClock, or a callable returning "
        f"seconds, got {clock!r}"
    )


class VirtualBackend:
    """The simulated device runtime behind ``virtual:N`` devices."""

    kind: ClassVar[str] = "virtual"
    #: wake_hint() gives the exact time of the next completion: the waiter needs no strategy
    completion_times: ClassVar[bool] = True

    def __init__(
        self,
        *,
        devices: int = 1,
        clock: object = None,
        compute_slots: int = 1,
        h2d_slots: int = 1,
        d2h_slots: int = 1,
        bandwidth: float = DEFAULT_BANDWIDTH,
        latency: float = DEFAULT_LATENCY,
        d2d_bandwidth: float = DEFAULT_D2D_BANDWIDTH,
    ) -> None:
        slots = {"compute": compute_slots, "h2d": h2d_slots, "d2h": d2h_slots}
        self._bandwidth = {"h2d": bandwidth, "d2h": bandwidth, "d2d": d2d_bandwidth}
        self._latency = latency
        self._live_memory: set[_Memory] = set()
        self._races: list[Race] = []
        self._lock = threading.RLock()
        self._clock_ns, self._manual = _resolve_clock(clock)
        self._unlisten = self._manual._listen(self._notify) if self._manual else None
        self._devices = [_Device(i, slots) for i in range(devices)]
        # heap of (end, device, stream, seq, item): simultaneous ends finish in stream order
        self._running: list[tuple[int, int, int, int, _Item]] = []
        self._active: dict[_Stream, None] = {}  # streams with queued items, in order
        self._dirty = False
        self._t = self._clock_ns()
        self._seq = itertools.count(1)
        self._event_ids = itertools.count(1)
        self._closed = False
        self._listeners: list[Callable[[], None]] = []
        self._live_streams: set[_Stream] = set()
        self._live_events: set[_Event] = set()
        self._live_targets: set[_Target] = set()
        self._pending_ops = 0
        self._timeline: deque[tuple[tuple[int, int, int, int], OpRecord]] = deque(
            maxlen=_TIMELINE_LIMIT
        )
        self._ipc: weakref.WeakValueDictionary[int, _EventState] = weakref.WeakValueDictionary()
        self._token = secrets.token_bytes(8)

    # ------------------------------------------------------------------ lifecycle and checks

    def device_count(self) -> int:
        return len(self._devices)

    def close(self) -> None:
        """Retire this backend: every later use of its objects raises ``StaleHandleError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._unlisten is not None:
                self._unlisten()
        self._notify()  # pending waits wake up and see the error

    def _check_open(self) -> None:
        if self._closed:
            raise StaleHandleError(
                "this object belongs to a virtual backend that aiostream.virtual.reset() "
                "replaced; create new streams and events after the reset"
            )

    def _check_device(self, device: _Device) -> None:
        self._check_open()
        if device.failure is not None:
            raise device.failure.error()

    def _now(self) -> int:
        """Bring the simulation to the clock's now (lock held) and return it."""
        now = self._clock_ns()
        if now < self._t:  # a clock must not run backwards; keep the timeline monotonic
            now = self._t
        self._sync(now)
        return now

    # ------------------------------------------------------------------ the simulation

    def _sync(self, now: int) -> None:
        while True:
            if self._dirty:
                self._dispatch(self._t)
            if not self._running or self._running[0][0] > now:
                break
            t = self._running[0][0]
            self._t = t
            while self._running and self._running[0][0] == t:
                self._finish(heapq.heappop(self._running)[-1])
            self._dirty = True
        if now > self._t:
            self._t = now

    def _dispatch(self, t: int) -> None:
        """Start, at time ``t``, everything that can start (lock held).

        Among operations ready for one engine: the higher-priority stream first, then the one
        ready first, then the one submitted first; operations submitted at the same instant go
        in stream order (device, stream id), so that the timeline does not depend on which
        task the event loop happened to run first (trio randomises that on purpose).
        """
        while True:  # complete ready markers to a fixpoint: one may free another stream's head
            candidates: list[tuple[int, int, int, int, int, int, _Item]] = []
            completed = False
            for stream in list(self._active):
                queue = stream.queue
                while queue:
                    item = queue[0]
                    ready = item.submit
                    for dep in item.deps:
                        if dep.state != _DONE:
                            break
                        if dep.end > ready:
                            ready = dep.end
                    else:
                        if item.engine is None:  # a marker completes once it is ready
                            queue.popleft()
                            item.start = item.end = ready
                            item.state = _DONE
                            item.deps = []
                            completed = True
                            continue
                        item.ready = ready
                        candidates.append(
                            (stream.priority, ready, item.submit, *item.order(), item)
                        )
                    break
                if not queue:
                    del self._active[stream]
            if not completed:
                break
        # Starting an operation makes nothing else ready (its successors wait for its end),
        # so the last pass saw every candidate.
        candidates.sort(key=lambda c: c[:6])
        for *_, item in candidates:
            engine = item.device.engines[item.engine]  # type: ignore[index]
            if engine.stalled or engine.busy >= engine.slots:
                continue
            engine.busy += 1
            item.stream.queue.popleft()
            item.state = _RUNNING
            item.start = t
            item.end = t + item.duration
            item.deps = []
            heapq.heappush(self._running, (item.end, *item.order(), item))
            if item.on_start is not None:
                item.on_start()
        self._dirty = False

    def _reopen_instant(self, t: int) -> None:
        """Undo the starts made at instant ``t``, so that they are decided again with the
        operation being submitted now.

        Nothing observable has happened in zero time (the operations are running, not done),
        so the instant's choices can be remade; this keeps same-instant submissions from
        different tasks independent of their order.
        """
        running = self._running
        provisional = [e for e in running if e[-1].start == t and e[-1].duration > 0]
        if not provisional:
            return
        self._running = [e for e in running if not (e[-1].start == t and e[-1].duration > 0)]
        heapq.heapify(self._running)
        for *_, item in sorted(provisional, key=lambda e: e[-1].seq, reverse=True):
            item.state = _PENDING
            item.start = item.end = -1
            item.device.engines[item.engine].busy -= 1  # type: ignore[index]
            item.stream.queue.appendleft(item)
            self._active[item.stream] = None
        self._dirty = True

    def _finish(self, item: _Item) -> None:
        """A running operation reached its end (lock held)."""
        item.state = _DONE
        item.device.engines[item.engine].busy -= 1  # type: ignore[index]
        self._complete(item)

    def _complete(self, item: _Item) -> None:
        """Account for a finished operation: timeline, failure, effect."""
        device = item.device
        self._pending_ops -= 1
        self._timeline.append(
            (
                (item.start, *item.order()),
                OpRecord(
                    name=item.name,
                    device=device.index,
                    stream=item.stream.id,
                    engine=item.engine,  # type: ignore[arg-type]
                    submitted=item.submit / 1e9,
                    start=item.start / 1e9,
                    end=item.end / 1e9,
                    error=item.error,
                ),
            )
        )
        if item.error is not None:
            if device.failure is None:
                device.failure = _Failure(
                    device.name,
                    f"{device.name}: operation {item.name!r} on stream {item.stream.id} "
                    f"failed at t={item.end / 1e9:.9f}s: {item.error}",
                )
                self._abort(device, item.end)
            return
        fn = item.fn
        item.fn = None
        if fn is not None:
            fn()

    def _abort(self, device: _Device, t: int) -> None:
        """A failed device runs nothing more: end its remaining work at ``t``, as aborted."""
        aborted = [e[-1] for e in self._running if e[-1].device is device]
        if aborted:
            self._running = [e for e in self._running if e[-1].device is not device]
            heapq.heapify(self._running)
        for stream in [s for s in self._active if s.device is device]:
            aborted.extend(stream.queue)
            stream.queue.clear()
            del self._active[stream]
        device.faults.clear()
        for item in sorted(aborted, key=lambda i: i.seq):
            if item.state == _RUNNING:
                device.engines[item.engine].busy -= 1  # type: ignore[index]
            else:
                item.start = t
            item.state = _DONE
            item.end = t
            item.deps = []
            if item.engine is not None:
                item.error = "aborted: the device had failed"
                self._complete(item)

    def _enqueue(
        self,
        stream: _Stream,
        duration: int,
        engine: str | None,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> _Item:
        """Submit an item on ``stream`` (lock held, device checked)."""
        now = self._now()
        if engine is not None:
            self._reopen_instant(now)
        deps = [d for d in stream.waits if d.state != _DONE]
        last = stream.last
        if last is not None and last.state != _DONE:
            deps.append(last)
        stream.waits = []
        if engine is not None and stream.device.faults:
            duration, error = self._apply_faults(stream, engine, duration, error)
        item = _Item(next(self._seq), stream, deps, now, duration, engine, fn, error, name)
        stream.queue.append(item)
        stream.last = item
        self._active[stream] = None
        if engine is not None:
            self._pending_ops += 1
        self._dispatch(now)
        return item

    def _settled(self) -> bool:
        """Lock-free: no completion has come due since the last sync (in doubt, False)."""
        running = self._running
        try:
            return not running or running[0][0] > self._clock_ns()
        except IndexError:  # emptied by another thread meanwhile
            return False

    def _apply_faults(
        self, stream: _Stream, engine: str, duration: int, error: str | None
    ) -> tuple[int, str | None]:
        faults = stream.device.faults
        for fault in faults:
            if (fault.stream is None or fault.stream is stream) and (
                fault.engine is None or fault.engine == engine
            ):
                fault.remaining -= 1
                if fault.message is not None and error is None:
                    error = fault.message
                if fault.factor is not None:
                    duration = round(duration * fault.factor)
        faults[:] = [f for f in faults if f.remaining > 0]
        return duration, error

    def inject(
        self,
        index: int,
        stream: _Stream | None,
        engine: str | None,
        count: int,
        *,
        message: str | None = None,
        factor: float | None = None,
    ) -> None:
        """Make the next ``count`` operations on ``stream``/``engine`` fail or run slower."""
        with self._lock:
            self._check_device(self._devices[index])
            self._devices[index].faults.append(_Fault(stream, engine, count, message, factor))

    def stall(self, index: int, engine: str, stalled: bool) -> None:
        """Stop (or let again) the engine from starting operations; running ones go on."""
        with self._lock:
            self._check_open()
            self._now()
            self._devices[index].engines[engine].stalled = stalled
            self._dirty = True
            self._sync(self._t)
        self._notify()

    def _item_done(self, item: _Item) -> bool:
        device = item.device
        if item.state == _DONE and device.failure is None and not self._closed and self._settled():
            return True
        with self._lock:
            self._check_open()
            self._now()
            if device.failure is not None:
                raise device.failure.error()
            return item.state == _DONE

    def _target(self, item: _Item) -> _Target:
        target = _Target(self, item)
        self._live_targets.add(target)
        return target

    def _release_wait(self, target: _Target) -> None:
        with self._lock:
            self._live_targets.discard(target)

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    # ------------------------------------------------------------------ streams

    def priority_range(self, index: int) -> tuple[int, int]:
        return PRIORITY_RANGE

    def stream_create(self, index: int, priority: int) -> _Stream:
        with self._lock:
            self._check_open()
            device = self._devices[index]
            stream = _Stream(device, next(device.stream_ids), priority)
            self._live_streams.add(stream)
            return stream

    def stream_default(self, index: int) -> _Stream:
        self._check_open()
        return self._devices[index].default

    def stream_destroy(self, stream: _Stream) -> None:
        # Never raises: finalizers call it, also after a reset. Queued work still runs.
        with self._lock:
            if stream.destroyed or stream.default:
                return
            stream.destroyed = True
            self._live_streams.discard(stream)

    def stream_id(self, stream: _Stream) -> int:
        return stream.id

    def stream_query(self, stream: _Stream) -> bool:
        last = stream.last
        if (
            (last is None or last.state == _DONE)
            and not stream.waits
            and stream.device.failure is None
            and not self._closed
            and self._settled()
        ):
            return True
        with self._lock:
            self._check_device(stream.device)
            self._now()
            self._check_device(stream.device)
            return (last is None or last.state == _DONE) and all(
                w.state == _DONE for w in stream.waits
            )

    def stream_wait_event(self, stream: _Stream, event: _Event) -> None:
        with self._lock:
            self._check_device(stream.device)
            item = event.state.item
            if item is not None and item.state != _DONE:
                stream.waits.append(item)

    def stream_capture(self, stream: _Stream) -> _Target:
        with self._lock:
            self._check_device(stream.device)
            return self._target(self._enqueue(stream, 0, None, None, None, "sync"))

    # ------------------------------------------------------------------ events

    def event_create(
        self, index: int, *, timing: bool, blocking: bool, interprocess: bool
    ) -> _Event:
        with self._lock:
            self._check_open()
            state = _EventState(next(self._event_ids), timing)
            event = _Event(self._devices[index], state, interprocess)
            self._live_events.add(event)
            return event

    def event_destroy(self, event: _Event) -> None:
        with self._lock:
            if event.destroyed:
                return
            event.destroyed = True
            self._live_events.discard(event)

    def event_id(self, event: _Event) -> int:
        return event.state.id

    def event_record(self, event: _Event, stream: _Stream) -> None:
        with self._lock:
            self._check_device(stream.device)
            event.state.item = self._enqueue(stream, 0, None, None, None, "record")

    def event_query(self, event: _Event) -> bool:
        item = event.state.item
        if item is None:
            with self._lock:
                self._check_open()
                self._now()
                self._check_device(event.device)
            return True
        return self._item_done(item)

    def event_capture(self, event: _Event) -> _Target:
        with self._lock:
            self._check_device(event.device)
            item = event.state.item
            if item is None:  # never recorded: complete
                now = self._now()
                item = _Item(0, event.device.default, [], now, 0, None, None, None, "sync")
                item.start = item.end = now
                item.state = _DONE
            return self._target(item)

    def event_elapsed_ms(self, start: _Event, end: _Event) -> float:
        with self._lock:
            self._check_device(end.device)
            self._now()
            self._check_device(end.device)
            a, b = start.state.item, end.state.item
            if a is None or b is None:
                raise ValueError("elapsed_time() needs two recorded events")
            if a.state != _DONE or b.state != _DONE:
                raise NotReadyError(
                    "elapsed_time() needs both events complete; await synchronize() on the "
                    "later one first"
                )
            return (b.end - a.end) / 1e6

    def event_ipc_handle(self, event: _Event) -> bytes:
        with self._lock:
            self._check_open()
            self._ipc[event.state.id] = event.state
            body = _IPC_MAGIC + self._token + struct.pack("<IQ", event.device.index, event.state.id)
            return body.ljust(_IPC_SIZE, b"\x00")

    def event_from_ipc_handle(self, index: int, data: bytes) -> _Event:
        with self._lock:
            self._check_open()
            if data[:16] != _IPC_MAGIC:
                raise ValueError("handle is not an IPC handle of a virtual event")
            if data[16:24] != self._token:
                raise StaleHandleError(
                    "the IPC handle comes from another virtual backend (another process, or "
                    "one that aiostream.virtual.reset() replaced); the virtual backend shares "
                    "events within one process only"
                )
            dev_index, eid = struct.unpack("<IQ", data[24:36])
            if dev_index != index:
                raise ValueError(
                    f"the IPC handle is of an event on virtual:{dev_index}, not virtual:{index}"
                )
            state = self._ipc.get(eid)
            if state is None:
                raise ValueError("the event behind this IPC handle no longer exists")
            event = _Event(self._devices[index], state, True)
            self._live_events.add(event)
            return event

    # ------------------------------------------------------------------ work

    def delay(self, stream: _Stream, seconds: float) -> None:
        self.submit(stream, seconds_to_ns(seconds, "seconds"), "compute", None, None, "delay")

    def submit(
        self,
        stream: _Stream,
        duration_ns: int,
        engine: str,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> None:
        with self._lock:
            self._check_device(stream.device)
            self._enqueue(stream, duration_ns, engine, fn, error, name)

    # ------------------------------------------------------------------ memory and copies

    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> _Memory:
        with self._lock:
            self._check_open()
            mem = _Memory(nbytes, self._devices[index], host=True, pinned=pinned)
            self._live_memory.add(mem)
            return mem

    def host_view(self, host: _Memory) -> memoryview:
        return memoryview(host.data)

    def host_access(self, host: _Memory) -> None:
        if not host.inflight:
            return
        with self._lock:
            self._now()
            if not host.inflight:
                return
            writer = next((w for w in host.writers if w.state != _DONE), None)
            copy = (
                f"{writer.name!r} on {writer.device.name} stream {writer.stream.id} "
                f"(submitted at t={writer.submit / 1e9:.9f}s)"
                if writer is not None
                else "a copy"
            )
            where = "".join(traceback.format_stack(limit=10)[:-2])  # up to the .numpy() call
            self._races.append(Race(len(host.data), copy, where))

    def races(self, clear: bool = False) -> list[Race]:
        with self._lock:
            found = list(self._races)
            if clear:
                self._races.clear()
            return found

    def host_free(self, host: _Memory) -> None:
        with self._lock:
            host.freed = True
            self._live_memory.discard(host)

    def device_alloc(self, index: int, nbytes: int, stream: _Stream | None) -> _Memory:
        with self._lock:
            self._check_device(self._devices[index])
            mem = _Memory(nbytes, self._devices[index], host=False, pinned=False)
            self._live_memory.add(mem)
            return mem

    def device_free(self, mem: _Memory) -> None:
        # The bytes live on while a copy's closure holds them: freeing never races a copy.
        self.host_free(mem)

    def device_ptr(self, mem: _Memory) -> int:
        raise AttributeError("virtual device memory has no device address")

    def copy(self, stream: _Stream, dst: _Memory, src: _Memory, nbytes: int, kind: str) -> None:
        engine = _COPY_ENGINES[kind]
        seconds = self._latency + nbytes / self._bandwidth[kind]

        def begin() -> None:  # the destination holds poison from the copy's start
            dst.data[:nbytes] = _POISON_BYTE * nbytes

        def land() -> None:  # data moves when the copy completes
            dst.data[:nbytes] = src.data[:nbytes]
            dst.inflight -= 1
            dst.writers.remove(item)

        with self._lock:
            self._check_device(stream.device)
            item = self._enqueue(stream, round(seconds * 1e9), engine, land, None, f"copy {kind}")
            dst.inflight += 1
            dst.writers.append(item)
            item.on_start = begin
            if item.state == _RUNNING:  # it started at once, before the hook was set
                begin()

    # ------------------------------------------------------------------ waiting

    def wake_hint(self, index: int) -> float | None:
        with self._lock:
            if self._closed:
                return 0.0
            now = self._now()
            if self._manual is not None or not self._running:
                return None
            return (self._running[0][0] - now) / 1e9

    def subscribe(self, index: int, callback: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return unsubscribe

    def wait_blocking(self, target: _Target) -> None:
        changed = threading.Event()
        unsubscribe = self.subscribe(0, changed.set)
        try:
            while not target.done():
                changed.wait(self.wake_hint(0))
                changed.clear()
        finally:
            unsubscribe()

    def device_name(self, index: int) -> str:
        return "simulated"

    def stream_wrap(self, index: int, handle: int) -> tuple[object, int]:
        raise ValueError("virtual devices have no foreign streams: ExternalStream wraps CUDA ones")

    def event_wrap(self, index: int, handle: int) -> object:
        raise ValueError("virtual devices have no foreign events: as_event wraps CUDA ones")

    def block(self, target: _Target) -> None:
        try:
            self.wait_blocking(target)
        except AiostreamError:
            pass  # the caller learns the outcome from target.done()

    def notify_done(self, target: _Target, fn: Callable[[], None]) -> None:
        def watch() -> None:
            self.block(target)
            fn()

        threading.Thread(target=watch, name="aiostream virtual notify", daemon=True).start()

    # ------------------------------------------------------------------ inspection

    def stats(self) -> VirtualStats:
        with self._lock:
            if not self._closed:
                self._now()
            return VirtualStats(
                streams=len(self._live_streams),
                events=len(self._live_events),
                operations=self._pending_ops,
                waits=len(self._live_targets),
                buffers=len(self._live_memory),
            )

    def leaks(self) -> list[str]:
        """One line per live stream, live event, pending operation and pending wait."""
        with self._lock:
            if not self._closed:
                self._now()
            lines = []
            for t in sorted(self._live_targets, key=lambda t: t.seq):
                item = t._item
                lines.append(
                    f"pending wait on {item.device.name} stream {item.stream.id} "
                    f"(for the work before its {item.name!r} at t={item.submit / 1e9:.9f}s)"
                )
            pending = [i for s in self._active for i in s.queue if i.engine is not None]
            pending += [e[-1] for e in self._running]
            for item in sorted(pending, key=lambda i: i.seq):
                when = (
                    f"running until t={item.end / 1e9:.9f}s"
                    if item.state == _RUNNING
                    else "not started"
                )
                lines.append(
                    f"pending operation {item.name!r} on {item.device.name} stream "
                    f"{item.stream.id}, engine {item.engine}, submitted at "
                    f"t={item.submit / 1e9:.9f}s, {when}"
                )
            for stream in sorted(self._live_streams, key=lambda s: (s.device.index, s.id)):
                lines.append(
                    f"live stream {stream.device.name} stream {stream.id} "
                    f"(priority {stream.priority})"
                )
            for event in sorted(self._live_events, key=lambda e: e.state.id):
                lines.append(f"live event {event.device.name} event {event.state.id}")
            for mem in sorted(self._live_memory, key=lambda m: (m.host, len(m.data))):
                where = "host" if mem.host else mem.device.name
                lines.append(f"live buffer of {len(mem.data)} bytes on {where}")
            return lines

    def timeline(self) -> list[OpRecord]:
        with self._lock:
            if not self._closed:
                self._now()
            return [record for _, record in sorted(self._timeline, key=_by_key)]

    def now(self) -> float:
        """The device clock in seconds."""
        return self._clock_ns() / 1e9


def _by_key(entry: tuple[tuple[int, int, int, int], OpRecord]) -> tuple[int, int, int, int]:
    return entry[0]
