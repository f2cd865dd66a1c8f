"""The virtual backend's facade: the Backend protocol over the scheduler, under one lock.

Device time is kept in integer nanoseconds, read from one clock per backend (the monotonic
clock, a manual :class:`VirtualClock`, or any callable returning seconds), so that arithmetic on
it is exact and a program gives the same timeline on every run.

The simulation is lazy: nothing happens between calls. Every call first brings the scheduler
to the clock's "now" (``_now``), which processes the completions that came due in time order.
"""

from __future__ import annotations

import itertools
import secrets
import struct
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from ..._errors import AiostreamError, DeviceError, NotReadyError, StaleHandleError
from . import inspect
from .clock import Listeners, resolve_clock, seconds_to_ns
from .model import (
    DONE,
    PRIORITY_RANGE,
    RUNNING,
    Device,
    Event,
    EventState,
    Fault,
    Item,
    Memory,
    OpRecord,
    Race,
    Stream,
    VirtualStats,
)
from .options import VirtualOptions
from .scheduler import Scheduler

__all__ = ["POISON", "Target", "VirtualBackend"]

#: The byte value that fills a copy's destination from the copy's start until it completes.
POISON = 0xA5
_COPY_ENGINES = {"h2d": "h2d", "d2h": "d2h", "d2d": "compute"}
_IPC_MAGIC = b"aiostream:virt\x00\x01"  # 16 bytes
_IPC_SIZE = 64
_NEVER = float("inf")


class Target:
    """One wait's captured work: an item, and whoever watches for its completion."""

    __slots__ = ("_backend", "_callback", "_item", "_released", "lane", "seq")

    def __init__(self, backend: VirtualBackend, item: Item) -> None:
        self._backend = backend
        self._item = item
        self._released = False
        self._callback: Callable[[], None] | None = None
        self.lane: object = item.stream
        self.seq = item.seq

    def done(self) -> bool:
        return self._backend._item_done(self._item)

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from any thread, when the work completes or fails or the
        backend closes; at once if it already has."""
        self._backend._watch(self, callback)

    def __call__(self) -> None:  # the scheduler calls its watchers
        callback, self._callback = self._callback, None
        if callback is not None and not self._released:
            callback()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._callback = None
            self._backend._release_wait(self)


class VirtualBackend:
    """The simulated device runtime behind ``virtual:N`` devices."""

    kind: ClassVar[str] = "virtual"
    #: wake_hint() gives the exact time of the next completion: the waiter needs no strategy
    completion_times: ClassVar[bool] = True

    def __init__(self, options: VirtualOptions | None = None, *, clock: object = None) -> None:
        options = options if options is not None else VirtualOptions()
        self.options = options
        self._bandwidth = {
            "h2d": options.bandwidth,
            "d2h": options.bandwidth,
            "d2d": options.d2d_bandwidth,
        }
        self._latency = options.latency
        self._lock = threading.RLock()
        self._clock_ns, self._manual = resolve_clock(clock)
        slots = options.slots()
        self._devices = [Device(i, slots) for i in range(options.devices)]
        self._sched = Scheduler(self._devices, self._clock_ns())
        self._closed = False
        self._listeners = Listeners()
        self._unlisten = self._manual._listen(self._listeners) if self._manual else None
        self._hinted: float = _NEVER  # the earliest completion a waiter was told to sleep until
        self._live_memory: set[Memory] = set()
        self._races: list[Race] = []
        self._live_streams: set[Stream] = set()
        self._live_events: set[Event] = set()
        self._live_targets: dict[Target, None] = {}
        self._event_ids = itertools.count(1)
        self._ipc: weakref.WeakValueDictionary[int, EventState] = weakref.WeakValueDictionary()
        self._token = secrets.token_bytes(8)

    # ------------------------------------------------------------------ lifecycle and checks

    def device_count(self) -> int:
        return len(self._devices)

    def device_name(self, index: int) -> str:
        return "simulated"

    def close(self) -> None:
        """Retire this backend: every later use of its objects raises ``StaleHandleError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._unlisten is not None:
                self._unlisten()
            targets = list(self._live_targets)
        for target in targets:  # pending waits wake up and see the error
            target()
        self._listeners()

    def _check_open(self) -> None:
        if self._closed:
            raise StaleHandleError(
                "this object belongs to a virtual backend that aiostream.virtual.reset() "
                "replaced; create new streams and events after the reset"
            )

    def _check_device(self, device: Device) -> None:
        self._check_open()
        if device.failure is not None:
            raise device.failure.error()

    def _now(self) -> int:
        """Bring the simulation to the clock's now (lock held) and return it."""
        sched = self._sched
        now = self._clock_ns()
        if now < sched.t:  # a clock must not run backwards; keep the timeline monotonic
            now = sched.t
        sched.advance(now)
        return now

    def _settled(self) -> bool:
        """Lock-free: no completion has come due since the last sync (in doubt, False)."""
        running = self._sched.running
        try:
            return not running or running[0][0] > self._clock_ns()
        except IndexError:  # emptied by another thread meanwhile
            return False

    def _item_done(self, item: Item) -> bool:
        device = item.device
        if item.state == DONE and device.failure is None and not self._closed and self._settled():
            return True
        with self._lock:
            self._check_open()
            self._now()
            if device.failure is not None:
                raise device.failure.error()
            return item.state == DONE

    def _submit(
        self,
        stream: Stream,
        duration: int,
        engine: str | None,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> Item:
        """Submit on ``stream`` (lock held, device checked); wake waiters if it ends sooner
        than they sleep."""
        self._now()
        item = self._sched.submit(stream, duration, engine, fn, error, name)
        # A waiter told "nothing runs" (_NEVER) needs no wake: with nothing running, all
        # pending work is held by a stalled engine, which only a release (it notifies) frees.
        if engine is not None and self._hinted != _NEVER:
            end = self._sched.next_end()
            if end is not None and end < self._hinted:
                self._hinted = end
                self._listeners()
        return item

    # ------------------------------------------------------------------ streams

    def priority_range(self, index: int) -> tuple[int, int]:
        return PRIORITY_RANGE

    def stream_create(self, index: int, priority: int) -> Stream:
        with self._lock:
            self._check_open()
            device = self._devices[index]
            stream = Stream(device, next(device.stream_ids), priority)
            self._live_streams.add(stream)
            return stream

    def stream_default(self, index: int) -> Stream:
        self._check_open()
        return self._devices[index].default

    def stream_wrap(self, index: int, handle: int) -> tuple[object, int]:
        raise ValueError("virtual devices have no foreign streams: ExternalStream wraps CUDA ones")

    def stream_destroy(self, stream: Stream) -> None:
        # Never raises: finalizers call it, also after a reset. Queued work still runs.
        with self._lock:
            if stream.destroyed or stream.default:
                return
            stream.destroyed = True
            self._live_streams.discard(stream)

    def stream_id(self, stream: Stream) -> int:
        return stream.id

    def stream_query(self, stream: Stream) -> bool:
        last = stream.last
        if (
            (last is None or last.state == DONE)
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
            return (last is None or last.state == DONE) and all(
                w.state == DONE for w in stream.waits
            )

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        with self._lock:
            self._check_device(stream.device)
            self._sched.wait_event(stream, event.state.item)

    def stream_capture(self, stream: Stream) -> Target:
        with self._lock:
            self._check_device(stream.device)
            last = stream.last
            if last is not None and not stream.waits:
                # Work on a stream completes in order: its last item stands for all of it,
                # and a wait costs no marker (100,000 pending waits are ordinary).
                return self._target(last)
            return self._target(self._submit(stream, 0, None, None, None, "sync"))

    # ------------------------------------------------------------------ events

    def event_create(
        self, index: int, *, timing: bool, blocking: bool, interprocess: bool
    ) -> Event:
        with self._lock:
            self._check_open()
            state = EventState(next(self._event_ids), timing)
            event = Event(self._devices[index], state, interprocess)
            self._live_events.add(event)
            return event

    def event_wrap(self, index: int, handle: int) -> object:
        raise ValueError("virtual devices have no foreign events: as_event wraps CUDA ones")

    def event_destroy(self, event: Event) -> None:
        with self._lock:
            if event.destroyed:
                return
            event.destroyed = True
            self._live_events.discard(event)

    def event_id(self, event: Event) -> int:
        return event.state.id

    def event_record(self, event: Event, stream: Stream) -> None:
        with self._lock:
            self._check_device(stream.device)
            event.state.item = self._submit(stream, 0, None, None, None, "record")

    def event_query(self, event: Event) -> bool:
        item = event.state.item
        if item is None:
            with self._lock:
                self._check_open()
                self._now()
                self._check_device(event.device)
            return True
        return self._item_done(item)

    def event_capture(self, event: Event) -> Target:
        with self._lock:
            self._check_device(event.device)
            item = event.state.item
            if item is None:  # never recorded: complete
                now = self._now()
                item = Item(0, event.device.default, now, 0, None, None, None, "sync")
                item.start = item.end = now
                item.state = DONE
            return self._target(item)

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        with self._lock:
            self._check_device(end.device)
            self._now()
            self._check_device(end.device)
            a, b = start.state.item, end.state.item
            if a is None or b is None:
                raise ValueError("elapsed_time() needs two recorded events")
            if a.state != DONE or b.state != DONE:
                raise NotReadyError(
                    "elapsed_time() needs both events complete; await synchronize() on the "
                    "later one first"
                )
            return (b.end - a.end) / 1e6

    def event_ipc_handle(self, event: Event) -> bytes:
        with self._lock:
            self._check_open()
            self._ipc[event.state.id] = event.state
            body = _IPC_MAGIC + self._token + struct.pack("<IQ", event.device.index, event.state.id)
            return body.ljust(_IPC_SIZE, b"\x00")

    def event_from_ipc_handle(self, index: int, data: bytes) -> Event:
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
            event = Event(self._devices[index], state, True)
            self._live_events.add(event)
            return event

    # ------------------------------------------------------------------ work

    def delay(self, stream: Stream, seconds: float) -> None:
        self.submit(stream, seconds_to_ns(seconds, "seconds"), "compute", None, None, "delay")

    def submit(
        self,
        stream: Stream,
        duration_ns: int,
        engine: str,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> None:
        with self._lock:
            self._check_device(stream.device)
            self._submit(stream, duration_ns, engine, fn, error, name)

    def inject(
        self,
        index: int,
        stream: Stream | None,
        engine: str | None,
        count: int,
        *,
        message: str | None = None,
        factor: float | None = None,
    ) -> None:
        """Make the next ``count`` operations on ``stream``/``engine`` fail or run slower."""
        with self._lock:
            self._check_device(self._devices[index])
            self._devices[index].faults.append(Fault(stream, engine, count, message, factor))

    def stall(self, index: int, engine: str, stalled: bool) -> None:
        """Stop (or let again) the engine from starting operations; running ones go on."""
        with self._lock:
            self._check_open()
            self._now()
            self._sched.set_stalled(self._devices[index].engines[engine], stalled)
            self._now()
        self._listeners()

    # ------------------------------------------------------------------ memory and copies

    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> Memory:
        with self._lock:
            self._check_open()
            try:
                mem = Memory(nbytes, self._devices[index], host=True)
            except (MemoryError, OverflowError):
                raise MemoryError(f"cannot allocate {nbytes} bytes of host memory") from None
            self._live_memory.add(mem)
            return mem

    def host_view(self, host: Memory) -> memoryview:
        return memoryview(host.data)

    def host_access(self, host: Memory) -> None:
        if not host.writers:
            return
        with self._lock:
            self._now()
            if not host.writers:
                return
            writer = next(iter(host.writers))
            copy = (
                f"{writer.name!r} on {writer.device.name} stream {writer.stream.id} "
                f"(submitted at t={writer.submit / 1e9:.9f}s)"
            )
            where = "".join(traceback.format_stack(limit=10)[:-2])  # up to the .numpy() call
            self._races.append(Race(len(host.data), copy, where))

    def races(self, clear: bool = False) -> list[Race]:
        with self._lock:
            found = list(self._races)
            if clear:
                self._races.clear()
            return found

    def host_free(self, host: Memory) -> None:
        with self._lock:
            self._live_memory.discard(host)

    def device_alloc(self, index: int, nbytes: int, stream: Stream | None) -> Memory:
        with self._lock:
            device = self._devices[index]
            self._check_device(device)
            size = self.options.memory
            if nbytes > size - device.allocated:
                raise self._out_of_memory(device, nbytes, "")
            try:
                mem = Memory(nbytes, device, host=False)
            except (MemoryError, OverflowError):  # the host cannot hold the simulated bytes
                raise self._out_of_memory(device, nbytes, "; the host could not hold it") from None
            device.allocated += nbytes
            self._live_memory.add(mem)
            return mem

    def _out_of_memory(self, device: Device, nbytes: int, why: str) -> DeviceError:
        size = self.options.memory
        return DeviceError(
            f"{device.name} is out of memory: {nbytes} bytes asked, {size - device.allocated} "
            f"of {size} free{why} (aiostream.virtual.reset(memory=...) sets the size)",
            device=device.name,
        )

    def device_free(self, mem: Memory) -> None:
        # The bytes live on while a copy's closure holds them: freeing never races a copy.
        with self._lock:
            if mem in self._live_memory:
                mem.device.allocated -= len(mem.data)
            self._live_memory.discard(mem)

    def device_ptr(self, mem: Memory) -> int:
        raise AttributeError("virtual device memory has no device address")

    def copy(self, stream: Stream, dst: Memory, src: Memory, nbytes: int, kind: str) -> None:
        engine = _COPY_ENGINES[kind]
        seconds = self._latency + nbytes / self._bandwidth[kind]

        # Both run on whichever thread advances the simulation, usually the host's own: in
        # place (a fill and a memcpy), never building a temporary of the copy's size, whose
        # fresh pages would cost the host more than the copy itself.
        def begin() -> None:  # the destination holds poison from the copy's start
            np.frombuffer(dst.data, np.uint8, nbytes).fill(POISON)

        def land() -> None:  # data moves when the copy completes
            memoryview(dst.data)[:nbytes] = memoryview(src.data)[:nbytes]

        def settle() -> None:  # completed or aborted: no longer in flight
            dst.writers.pop(item, None)

        with self._lock:
            self._check_device(stream.device)
            item = self._submit(stream, round(seconds * 1e9), engine, land, None, f"copy {kind}")
            if item.state == DONE:  # zero-length and already landed
                return
            dst.writers[item] = None
            item.on_start = begin
            if item.state == RUNNING:  # it started at once, before the hook was set
                begin()
            if item.watchers is None:
                item.watchers = [settle]
            else:
                item.watchers.append(settle)

    # ------------------------------------------------------------------ waiting

    def _target(self, item: Item) -> Target:
        target = Target(self, item)
        self._live_targets[target] = None
        return target

    def _release_wait(self, target: Target) -> None:
        with self._lock:
            self._live_targets.pop(target, None)
            watchers = target._item.watchers
            if watchers is not None and target in watchers:
                watchers.remove(target)

    def _watch(self, target: Target, callback: Callable[[], None]) -> None:
        item = target._item
        with self._lock:
            if not (self._closed or item.state == DONE or item.device.failure is not None):
                target._callback = callback
                if item.watchers is None:
                    item.watchers = [target]
                else:
                    item.watchers.append(target)
                return
        callback()

    def wake_hint(self, index: int) -> float | None:
        with self._lock:
            if self._closed:
                return 0.0
            now = self._now()
            end = self._sched.next_end()
            if self._manual is not None or end is None:
                self._hinted = _NEVER
                return None
            self._hinted = end
            return (end - now) / 1e9

    def subscribe(self, index: int, callback: Callable[[], None]) -> Callable[[], None]:
        return self._listeners.add(callback)

    def wait_blocking(self, target: Target) -> None:
        changed = threading.Event()
        unsubscribe = self.subscribe(0, changed.set)
        try:
            while not target.done():
                changed.wait(self.wake_hint(0))
                changed.clear()
        finally:
            unsubscribe()

    def block(self, target: Target) -> None:
        try:
            self.wait_blocking(target)
        except AiostreamError:
            pass  # the caller learns the outcome from target.done()

    def notify_done(self, target: Target, fn: Callable[[], None]) -> None:
        def watch() -> None:
            self.block(target)
            fn()

        threading.Thread(target=watch, name="aiostream virtual notify", daemon=True).start()

    # ------------------------------------------------------------------ inspection

    def _synced(self) -> None:
        if not self._closed:
            self._now()

    def stats(self) -> VirtualStats:
        with self._lock:
            self._synced()
            return VirtualStats(
                streams=len(self._live_streams),
                events=len(self._live_events),
                operations=self._sched.pending_ops,
                waits=len(self._live_targets),
                buffers=len(self._live_memory),
            )

    def leaks(self) -> list[str]:
        """One line per live stream, live event, pending operation and pending wait."""
        with self._lock:
            self._synced()
            return inspect.leaks(
                sorted((t._item for t in self._live_targets), key=_by_seq),
                self._sched.unfinished_ops(),
                self._live_streams,
                self._live_events,
                self._live_memory,
            )

    def timeline(self) -> list[OpRecord]:
        with self._lock:
            self._synced()
            return self._sched.timeline()

    def now(self) -> float:
        """The device clock in seconds."""
        return self._clock_ns() / 1e9


def _by_seq(item: Item) -> int:
    return item.seq
