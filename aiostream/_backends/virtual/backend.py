"""The virtual backend's face: the :class:`Backend` protocol, the :class:`Timeline` capability
and the simulator's controls (faults, stalls), over the simulation (``simulation.py``), its
memory (``memory.py``) and its IPC (``sharing.py``). Work submitted to a capturing stream
becomes a node of the capture's graph instead (``graphs.py``)."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Collection
from typing import ClassVar

from ..._errors import NotReadyError
from ..base import Backend, Graphs, Timeline
from . import graphs, inspect
from .clock import seconds_to_ns
from .memory import POISON, Memories
from .model import (
    DONE,
    PRIORITY_RANGE,
    Event,
    EventState,
    Fault,
    Item,
    Memory,
    Op,
    OpRecord,
    Race,
    Stream,
    VirtualStats,
)
from .options import VirtualOptions
from .sharing import Sharing
from .simulation import Simulation, Target

__all__ = ["POISON", "Isolation", "Target", "VirtualBackend"]

_DLPACK_CPU = 1  # DLPack's kDLCPU


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


class VirtualBackend(Backend[Stream, Event, Memory, Target], Timeline, Graphs):
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
        self._sharing = Sharing(sim, self._memory)
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

    def stream_target(self, stream: Stream, wake: bool) -> Target:
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

    def event_target(self, event: Event, wake: bool) -> Target:
        sim = self._sim
        with sim.lock:
            sim.check_device(event.device)
            graphs.check_awaitable_event(event)
            item = event.state.item
            if item is None:  # never recorded: complete
                now = sim.now_locked()
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
        return self._sharing.event_ipc_handle(event)

    def event_from_ipc_handle(self, index: int, data: bytes) -> Event:
        with self._sim.lock:
            event = self._sharing.event_from_ipc_handle(index, data)
            self._live_events.add(event)
            return event

    # ------------------------------------------------------------------ device work

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
        sim = self._sim
        with sim.lock:
            sim.check_device(stream.device)
            if stream.capture is not None:  # a node, submitted at each launch
                stream.capture.add(stream, Op(duration_ns, engine, fn, error, name))
                return
            sim.submit_locked(stream, duration_ns, engine, fn, error, name)

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
        with self._sim.lock:
            device = self._sim.devices[index]
            self._sim.check_device(device)
            device.faults.append(Fault(stream, engine, count, message, factor))

    def stall(self, index: int, engine: str, stalled: bool) -> None:
        """Hold (or release) one stall of the engine: it starts no operation while any is
        held; running ones go on."""
        sim = self._sim
        with sim.lock:
            sim.check_open()
            sim.now_locked()
            sim.sched.set_stalled(sim.devices[index].engines[engine], stalled)
            sim.now_locked()
        sim.listeners()

    # ------------------------------------------------------------------ memory and copies

    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> Memory:
        return self._memory.host_alloc(index, nbytes, pinned)

    def host_view(self, host: Memory) -> memoryview:
        return memoryview(host.data)

    def host_access(self, host: Memory) -> None:
        self._memory.host_access(host)

    def races(self, clear: bool = False) -> list[Race]:
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

    def copy(self, stream: Stream, dst: Memory, src: Memory, nbytes: int, kind: str) -> None:
        memory = self._memory
        with self._sim.lock:
            self._sim.check_device(stream.device)
            if stream.capture is not None:  # a node, submitted at each launch
                stream.capture.add(stream, memory.copy_op(dst, src, nbytes, kind))
                return
        memory.copy(stream, dst, src, nbytes, kind)

    # ------------------------------------------------------------------ sharing memory

    def dlpack_device(self, index: int) -> tuple[int, int]:
        # The simulated device memory is host memory, exported as such: NumPy and CPU PyTorch
        # read device buffers in tests (reading one while a copy into it is in flight is a
        # race, recorded as for a host view).
        return (_DLPACK_CPU, 0)

    def memory_export(self, mem: Memory) -> int:
        return self._memory.export(mem)

    def memory_wait(self, mem: Memory, stream: Stream) -> None:
        self._memory.wait_for_writers(mem, stream)

    def device_alloc_interprocess(self, index: int, nbytes: int, stream: Stream) -> Memory:
        return self._memory.device_alloc(index, nbytes)

    def memory_ipc_handle(self, mem: Memory) -> bytes:
        return self._sharing.ipc_handle(mem)

    def memory_from_ipc_handle(
        self, index: int, data: bytes, event: bytes, nbytes: int, stream: Stream
    ) -> Memory:
        return self._sharing.ipc_open(index, data, event, nbytes, stream)

    # ------------------------------------------------------------------ graphs

    def capture_begin(self, stream: Stream, mode: str) -> None:
        with self._sim.lock:
            self._sim.check_device(stream.device)
            graphs.check_capturable(stream)
            graphs.Capture(stream, mode)

    def capture_end(self, stream: Stream) -> graphs.Graph:
        with self._sim.lock:
            self._sim.check_open()
            return graphs.end(stream)

    def stream_capturing(self, stream: Stream) -> bool:
        return stream.capture is not None

    def graph_nodes(self, graph: graphs.Graph) -> int:
        return len(graph.nodes)

    def graph_launch(self, stream: Stream, graph: graphs.Graph) -> None:
        sim = self._sim
        with sim.lock:
            sim.check_device(stream.device)
            graphs.check_launch(graph, stream)  # a destroyed graph's included, as CUDA's
            sim.now_locked()
            graph.launch(stream, sim.sched)
            sim.submitted_locked()

    def graph_destroy(self, graph: graphs.Graph) -> None:
        """The nodes submitted by launches run on without the graph; a launch after this is
        refused, as the driver refuses a destroyed executable graph."""
        with self._sim.lock:
            graph.destroyed = True

    def graph_handles(self, graph: graphs.Graph) -> tuple[int, int]:
        """Opaque ids: the capture whose nodes the graph launches, and the graph's own."""
        with self._sim.lock:
            self._sim.check_open()
            return graph.source_id, graph.exec_id

    def graph_dump(self, graph: graphs.Graph, path: str, verbose: bool) -> None:
        with self._sim.lock:
            self._sim.check_open()
            text = graphs.dot(graph, verbose)
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)

    def graph_update(self, graph: graphs.Graph, source: graphs.Graph) -> str | None:
        sim = self._sim
        with sim.lock:
            sim.check_device(graph.device)  # a failed device's error, sticky as CUDA's
            graphs.check_updatable(graph, source)
            return graphs.update(graph, source)

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
