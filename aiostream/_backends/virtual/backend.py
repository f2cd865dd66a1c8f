"""The virtual backend's face: the :class:`Backend` protocol, the :class:`Timeline` capability
and the simulator's controls, over the simulation (``simulation.py``) and its memory
(``memory.py``)."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Collection
from typing import ClassVar

from ..._errors import NotReadyError
from ..base import Backend, Graphs, Timeline
from . import graphs, inspect
from .ipc import IpcTable
from .memory import POISON, Memories
from .model import (
    DONE,
    PRIORITY_RANGE,
    Event,
    EventState,
    Item,
    Memory,
    OpRecord,
    Race,
    Stream,
    VirtualStats,
)
from .options import VirtualOptions
from .sharing import Sharing
from .simulation import Simulation, Target
from .work import Work

__all__ = ["POISON", "Isolation", "Target", "VirtualBackend"]


class Isolation:
    """A test's own virtual backend (the pytest plugin's ``virtual_device``).

    ``aiostream.virtual.reset()`` inside the test keeps the fixture's clock (``virtual_time``'s,
    or the monotonic one) and hands the replaced backend here, so that what it leaked and the
    races it saw still fail the test at teardown.
    """

    def __init__(self, clock: object, *, virtual_time: bool) -> None:
        self.clock = clock
        self.virtual_time = virtual_time
        self.leaks: list[str] = []
        self.races: list[Race] = []

    def retire(self, backend: VirtualBackend) -> None:
        leaks = backend.leaks()
        if leaks:  # objects the test dropped release their handles first
            gc.collect()
            leaks = backend.leaks()
        self.leaks += [f"{line} (before aiostream.virtual.reset())" for line in leaks]
        self.races += backend.races()


class VirtualBackend(Sharing, Work, Backend[Stream, Event, Memory, Target], Timeline, Graphs):
    """The simulated device runtime behind ``virtual:N`` devices."""

    kind: ClassVar[str] = "virtual"
    #: wake_hint() gives the exact time of the next completion: the waiter needs no strategy
    completion_times: ClassVar[bool] = True

    def __init__(self, options: VirtualOptions | None = None, *, clock: object = None) -> None:
        options = options if options is not None else VirtualOptions()
        self.options = options
        self._sim = sim = Simulation(options, clock)
        profiled = options.profile is not None
        self._memory = Memories(sim, options.memory, options.copies(), profiled)
        self._live_streams: set[Stream] = set()
        self._live_events: set[Event] = set()
        self._event_ids = itertools.count(1)
        self._ipc = IpcTable()
        self.isolation: Isolation | None = None  # set by the pytest plugin's fixture

    def device_count(self) -> int:
        return len(self._sim.devices)

    def device_name(self, index: int) -> str:
        profile = self.options.profile
        if profile is not None:  # the device it was measured on, which may not be this one
            return f"simulated from a profile of {profile.describe()}"
        return "simulated"

    def close(self) -> None:
        """Retire this backend: every later use of its objects raises ``StaleHandleError``."""
        self._sim.close()

    # ------------------------------------------------------------------ streams

    def priority_range(self, index: int) -> tuple[int, int]:
        return PRIORITY_RANGE

    def stream_create(self, index: int, priority: int) -> Stream:
        sim = self._sim
        with sim.lock:
            sim.check_open()
            device = sim.devices[index]
            stream = Stream(device, next(device.stream_ids), priority)
            self._live_streams.add(stream)
            return stream

    def stream_default(self, index: int) -> Stream:
        self._sim.check_open()
        return self._sim.devices[index].default

    def stream_destroy(self, stream: Stream) -> None:
        # Never raises: finalizers call it, also after a reset. Queued work still runs. A
        # stream not counted live (a device's default stream, one destroyed) stays as it is.
        with self._sim.lock:
            self._live_streams.discard(stream)

    def stream_id(self, stream: Stream) -> int:
        return stream.id

    def stream_query(self, stream: Stream) -> bool:
        sim = self._sim
        last = stream.last
        if (
            (last is None or last.state == DONE)
            and stream.capture is None
            and not stream.waits
            and stream.device.failure is None
            and not sim.closed
            and sim.settled()
        ):
            return True
        with sim.lock:
            sim.check_device(stream.device)
            graphs.check_awaitable_stream(stream)
            sim.now_locked()
            sim.check_device(stream.device)
            return (last is None or last.state == DONE) and all(
                w.state == DONE for w in stream.waits
            )

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        with self._sim.lock:
            self._sim.check_device(stream.device)
            graphs.check_wait(stream, event)
            captured = event.state.captured
            if captured is not None:  # a point of a capture: the stream joins it there
                captured[0].join(stream, captured[1])
                return
            self._sim.sched.wait_event(stream, event.state.item)

    def stream_capture(self, stream: Stream, wake: bool) -> Target:
        sim = self._sim
        with sim.lock:
            sim.check_device(stream.device)
            graphs.check_awaitable_stream(stream)
            last = stream.last
            if last is not None and not stream.waits:
                # Work on a stream completes in order: its last item stands for all of it,
                # and a wait costs no marker (100,000 pending waits are ordinary).
                return sim.target_locked(last)
            return sim.target_locked(sim.submit_locked(stream, 0, None, None, None, "sync"))

    # ------------------------------------------------------------------ events

    def event_create(
        self, index: int, *, timing: bool, blocking: bool, interprocess: bool
    ) -> Event:
        with self._sim.lock:
            self._sim.check_open()
            state = EventState(next(self._event_ids), timing)
            event = Event(self._sim.devices[index], state, interprocess)
            self._live_events.add(event)
            return event

    def event_destroy(self, event: Event) -> None:
        with self._sim.lock:
            if event.destroyed:
                return
            event.destroyed = True
            self._live_events.discard(event)

    def event_id(self, event: Event) -> int:
        return event.state.id

    def event_record(self, event: Event, stream: Stream) -> None:
        with self._sim.lock:
            self._sim.check_device(stream.device)
            if stream.capture is not None:
                stream.capture.record(event, stream)
                return
            event.state.captured = None
            # equivalent mutant (unmarked): the duration 0 -> 1 or None: a marker's duration is
            # never read
            event.state.item = self._sim.submit_locked(stream, 0, None, None, None, "record")

    def event_query(self, event: Event, quick: bool = False) -> bool:
        graphs.check_awaitable_event(event)
        item = event.state.item
        if item is None:
            with self._sim.lock:
                self._sim.check_open()
                self._sim.now_locked()
                self._sim.check_device(event.device)
            return True
        return self._sim.item_done(item)

    def event_capture(self, event: Event, wake: bool) -> Target:
        sim = self._sim
        with sim.lock:
            sim.check_device(event.device)
            graphs.check_awaitable_event(event)
            item = event.state.item
            if item is None:  # never recorded: complete
                now = sim.now_locked()
                # equivalent mutant (unmarked): the duration 0 -> 1 or None: this complete item is
                # never submitted
                item = Item(0, event.device.default, now, 0, None, None, None, "sync")
                item.start = item.end = now
                item.state = DONE
            return sim.target_locked(item)

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        with self._sim.lock:
            self._sim.check_device(end.device)
            graphs.check_awaitable_event(start)
            graphs.check_awaitable_event(end)
            self._sim.now_locked()
            self._sim.check_device(end.device)
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
        with self._sim.lock:
            self._sim.check_open()
            return self._ipc.handle(event)

    def event_from_ipc_handle(self, index: int, data: bytes) -> Event:
        with self._sim.lock:
            self._sim.check_open()
            event = Event(self._sim.devices[index], self._ipc.open(index, data), True)
            self._live_events.add(event)
            return event

    # ------------------------------------------------------------------ memory and copies

    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> Memory:
        return self._memory.host_alloc(index, nbytes, pinned)

    def host_view(self, host: Memory) -> memoryview:
        return memoryview(host.data)

    def host_access(self, host: Memory) -> None:
        self._memory.host_access(host)

    # equivalent under mutation: the callers that take the default read a backend being discarded
    def races(self, clear: bool = False) -> list[Race]:  # pragma: no mutate
        return self._memory.take_races(clear)

    def host_free(self, host: Memory) -> None:
        self._memory.host_free(host)

    def device_alloc(self, index: int, nbytes: int, stream: Stream) -> Memory:
        return self._memory.device_alloc(index, nbytes)

    def device_free(self, mem: Memory) -> None:
        self._memory.device_free(mem)

    def memory_use(self, mem: Memory, stream: Stream) -> None:
        """Nothing to order: simulated work holds the bytes it uses until it completes."""

    def device_ptr(self, mem: Memory) -> int:
        raise AttributeError("virtual device memory has no device address")

    # ------------------------------------------------------------------ waiting

    def wake_hint(self, index: int) -> float | None:
        return self._sim.wake_hint()

    def subscribe(self, index: int, callback: Callable[[], None]) -> Callable[[], None]:
        return self._sim.listeners.add(callback)

    def wait_blocking(self, target: Target) -> None:
        self._sim.wait_blocking(target)

    # ------------------------------------------------------------------ inspection, timeline

    def stats(self) -> VirtualStats:
        with self._sim.lock:
            self._sim.sync_locked()
            return VirtualStats(
                streams=len(self._live_streams),
                events=len(self._live_events),
                operations=self._sim.sched.pending_ops,
                waits=len(self._sim.targets),
                buffers=len(self._memory.live),
            )

    def leaks(self, held: Collection[object] = ()) -> list[str]:
        """One line per live stream, live event, live buffer, pending operation and pending
        wait; the streams, events and buffers in ``held`` (handles: what the pytest plugin
        found held by a test's fixture values) are left out."""
        ids = {id(handle) for handle in held}
        with self._sim.lock:
            self._sim.sync_locked()
            return inspect.leaks(
                sorted((t.item for t in self._sim.targets), key=_by_seq),
                self._sim.sched.unfinished_ops(),
                [s for s in self._live_streams if id(s) not in ids],
                [e for e in self._live_events if id(e) not in ids],
                [m for m in self._memory.live if id(m) not in ids],
            )

    def timeline(self) -> list[OpRecord]:
        with self._sim.lock:
            self._sim.sync_locked()
            return self._sim.sched.timeline()

    def now(self) -> float:
        """The device clock in seconds."""
        return self._sim.clock_ns() / 1e9


def _by_seq(item: Item) -> int:
    return item.seq
