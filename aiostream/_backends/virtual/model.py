"""The virtual device's data: devices, engines, streams, work items, events, memory, records.

Plain records with slots and no behaviour beyond their own bookkeeping; the scheduler
(``scheduler.py``) moves items through their states and the facade (``backend.py``) hands them
out as opaque handles.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._errors import DeviceError

__all__ = [
    "DONE",
    "ENGINES",
    "PENDING",
    "PRIORITY_RANGE",
    "RUNNING",
    "Device",
    "Engine",
    "Event",
    "EventState",
    "Failure",
    "Fault",
    "Item",
    "Memory",
    "Op",
    "OpRecord",
    "Race",
    "Stream",
    "VirtualStats",
]

ENGINES = ("compute", "h2d", "d2h")
#: (lowest, highest) stream priority, as ``cuCtxGetStreamPriorityRange`` reports on recent GPUs.
PRIORITY_RANGE = (0, -5)

#: An item's states: submitted, started on its engine (operations only), completed.
PENDING, RUNNING, DONE = 0, 1, 2


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


@dataclass(frozen=True)
class Race:
    """The host touched a buffer while a copy into it was in flight."""

    nbytes: int
    copy: str
    where: str

    def __str__(self) -> str:
        return (
            f"host access to a {self.nbytes}-byte buffer while {self.copy} was in flight\n"
            f"{self.where}"
        )


class Failure:
    """Why a device failed: its first failed operation. Device errors are sticky."""

    __slots__ = ("cause", "device", "message")

    def __init__(self, device: str, message: str, cause: BaseException | None = None) -> None:
        self.device = device
        self.message = message
        self.cause = cause  # what a host function raised, when that failed the device

    def error(self) -> DeviceError:
        # A fresh exception per raise: concurrent tasks must not share one traceback.
        error = DeviceError(self.message, device=self.device)
        error.__cause__ = self.cause
        return error


class Engine:
    """One engine of a device: slots, and the operations ready to start on it.

    ``ready`` is a heap ordered by (stream priority, ready time, submission time, device,
    stream id, submission order): the order in which waiting operations take a free slot.
    ``provisional`` holds the operations started at instant ``provisional_t``, which a
    submission at that same instant may decide again (see ``Scheduler._reopen``): a heap
    whose top is the one that goes last.
    """

    __slots__ = (
        "busy",
        "dirty",
        "gap",
        "launch",
        "name",
        "provisional",
        "provisional_t",
        "ready",
        "slots",
        "stalled",
    )

    def __init__(self, name: str, slots: int, launch: int = 0, gap: int = 0) -> None:
        self.name = name
        self.slots = slots
        # a device profile's launch overhead (ns): what the engine takes starts no sooner than
        # ``launch`` after its submission and ``gap`` after the engine took it (a slot held)
        self.launch = launch
        self.gap = gap
        self.busy = 0
        self.stalled = 0  # stalls held on it (they nest): it starts nothing while > 0
        # may be able to start something: the scheduler will look
        self.dirty = False
        self.ready: list[tuple[int, int, int, int, int, int, Item]] = []
        self.provisional: list[tuple[int, int, int, int, int, int, Item]] = []
        self.provisional_t = -1


class Fault:
    """An injected fault: the next ``remaining`` matching operations fail or run slower."""

    __slots__ = ("engine", "factor", "message", "remaining", "stream")

    def __init__(
        self,
        stream: Stream | None,
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

    def matches(self, stream: Stream, engine: str) -> bool:
        # by id: a graph's replay runs a captured stream's nodes on a stream of its own with
        # the replay stream's id (the origin's) or the captured stream's (a fork's)
        return (self.stream is None or self.stream.id == stream.id) and (
            self.engine is None or self.engine == engine
        )


class Device:
    """A simulated device: engines, streams' ids, injected faults, and its unfinished items."""

    __slots__ = (
        "allocated",
        "default",
        "engines",
        "failure",
        "faults",
        "index",
        "live",
        "name",
        "stream_ids",
    )

    def __init__(self, index: int, slots: dict[str, int], lead: tuple[int, int] = (0, 0)) -> None:
        self.index = index
        self.name = f"virtual:{index}"
        self.engines = {name: Engine(name, n) for name, n in slots.items()}
        self.engines["compute"].launch, self.engines["compute"].gap = lead
        self.failure: Failure | None = None
        self.faults: list[Fault] = []
        self.stream_ids = itertools.count(1)
        #: items submitted and not completed, in submission order (a dict as an ordered set)
        self.live: dict[Item, None] = {}
        self.default = Stream(self, 0, 0)
        self.allocated = 0  # bytes of device memory in use


class Stream:
    __slots__ = ("capture", "device", "id", "last", "priority", "waits")

    def __init__(self, device: Device, sid: int, priority: int):
        self.device = device
        self.id = sid
        self.priority = priority
        self.last: Item | None = None  # the last item submitted
        self.waits: list[Item] = []  # event captures the next item waits for
        #: the graph capture it is part of (graphs.Capture), or None
        self.capture: Any = None


class Item:
    """An operation (``engine`` set) or a marker (``engine`` None) on a stream.

    An item waits for ``deps_left`` others (the previous item of its stream, the events its
    stream waits on); each of them, when it completes, counts it down and raises ``ready`` to
    its own end. Markers (event records, wait captures) take no engine slot: they complete the
    moment they are ready.
    """

    __slots__ = (
        "dependents",
        "deps_left",
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
        "token",
        "watchers",
    )

    def __init__(
        self,
        seq: int,
        stream: Stream,
        submit: int,
        duration: int,
        engine: Engine | None,
        fn: Callable[[], object] | None,
        error: str | None,
        name: str,
    ) -> None:
        self.seq = seq
        self.stream = stream
        self.device = stream.device
        self.submit = submit
        self.duration = duration
        self.engine = engine
        self.fn = fn
        self.error = error
        self.name = name
        self.on_start: Callable[[], object] | None = None
        self.deps_left = 0
        #: what waits for it: items, and (launch, node) pairs of graph nodes not made yet
        self.dependents: list[Any] | None = None
        #: called once when it completes (the waits watching it, a copy's bookkeeping)
        self.watchers: list[Callable[[], None]] | None = None
        self.ready = submit
        self.start = -1  # pragma: no mutate (equivalent: read only after the item starts or ends)
        self.end = -1  # pragma: no mutate (equivalent: read only after the item starts or ends)
        self.state = PENDING
        self.token = 0  # bumped at every start: tells a live completion entry from a stale one

    def key(self) -> tuple[int, int, int, int, int, int, Item]:
        """Its place in its engine's ready queue."""
        return (
            self.stream.priority,
            self.ready,
            self.submit,
            self.device.index,
            self.stream.id,
            self.seq,
            self,
        )


@dataclass(frozen=True, slots=True)
class Op:
    """An operation to submit: what the scheduler needs, and ``attach(item)``, the bookkeeping
    its item needs once submitted (a copy's: the bytes it writes are in flight)."""

    duration: int
    engine: str
    fn: Callable[[], object] | None
    error: str | None
    name: str
    attach: Callable[[Item], None] | None = None


class EventState:
    """What a recorded event captured; shared by every handle opened on one event (IPC)."""

    __slots__ = ("__weakref__", "captured", "id", "item", "timing")

    def __init__(self, eid: int, timing: bool) -> None:
        self.id = eid
        self.timing = timing
        self.item: Item | None = None
        #: (capture, point) when last recorded on a capturing stream (see graphs.py)
        self.captured: tuple[Any, tuple[int, ...]] | None = None


class Event:
    __slots__ = ("destroyed", "device", "interprocess", "state")

    def __init__(self, device: Device, state: EventState, interprocess: bool) -> None:
        self.device = device
        self.state = state
        self.interprocess = interprocess
        self.destroyed = False


class Memory:
    """Host or device memory of the simulator: bytes, and the copies that will write them."""

    __slots__ = ("data", "device", "host", "pinned", "writers")

    def __init__(self, nbytes: int, device: Device, *, host: bool, pinned: bool = False) -> None:
        self.data = bytearray(nbytes)
        self.device = device
        self.host = host
        self.pinned = pinned  # host memory page-locked: a profile's copies from it differ
        #: copies into it submitted and not completed, in submission order
        self.writers: dict[Item, None] = {}
