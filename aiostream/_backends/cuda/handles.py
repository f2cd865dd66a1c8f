"""The handles the CUDA backend gives out: streams, events and memory, each with its device's
index and whether the backend owns (and so destroys) it; how errors name them, and what an
event recorded in another library's capture is captured in (``FOREIGN``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["FOREIGN", "Event", "Memory", "Stream", "StreamKey", "describe_event", "describe_stream"]

#: A stream's identity across devices: (device index, stream id). Ids alone collide: the
#: legacy default stream of every device is id 0.
StreamKey = tuple[int, int]

#: what an event recorded in another library's capture is captured in (aiostream knows no more)
FOREIGN = object()


class Stream:
    __slots__ = (
        "__weakref__",
        "alive",
        "capture",
        "done_at",
        "doomed",
        "holds",
        "id",
        "index",
        "key",
        "ops",
        "owned",
        "private",
        "ptr",
        "reach",
        "recorded",
        "seq",
        "woke",
        "woke_at",
    )

    def __init__(self, ptr: Any, index: int, *, owned: bool) -> None:
        self.ptr = ptr
        self.index = index
        self.id = int(ptr)
        self.key: StreamKey = (index, self.id)
        self.owned = owned
        self.alive = True
        self.seq = itertools.count()  # the order of its captures
        # work submitted through aiostream (kernels, copies, waits, allocations; event records
        # and completion flags add none), only compared with its own earlier values
        self.ops = 0
        #: only aiostream submits to it: made here, and its handle never handed out
        self.private = owned
        #: memory that will record on this stream when it is freed (see Memory.streams): an
        #: owned stream is destroyed only once none is left
        self.holds = 0
        #: released by its owner while held: destroyed at the last hold
        self.doomed = False
        #: (mark, ops): the last thing on this private stream is the host function that
        #: announces ``mark``, added when ``ops`` was this (see Waits.idle)
        self.woke: Any = None
        self.woke_at = 0  # (two fields, not a tuple: no allocation per wait)
        #: the aiostream capture it is part of (graphs.Capture), or None
        self.capture: Any = None
        #: ``ops`` of the latest record here seen complete (-1: none): every event recorded
        #: with no more of the user's work captured no more, and is complete too
        self.done_at = -1
        #: (event, ops): the last event recorded here, with aiostream's mark after it, when
        #: ``ops`` was this (see Waits.idle)
        self.recorded: tuple[Any, int] | None = None
        #: (mark, ops): the first mark made here since ``ops`` was this: once it is reached,
        #: every event recorded here since captured no work that had not completed
        self.reach: tuple[Any, int] | None = None


class Event:
    __slots__ = (
        "__weakref__",
        "alive",
        "at",
        "captured",
        "index",
        "kept",
        "make",
        "mark",
        "owned",
        "private",
        "raw",
        "seq",
        "shares",
        "stream",
    )

    def __init__(
        self, ptr: Any, index: int, *, owned: bool, make: Callable[[Event], Any] | None = None
    ) -> None:
        #: the driver's event; None until ``make`` makes it, on first use (``ptr``)
        self.raw = ptr
        self.make = make
        self.index = index
        self.owned = owned
        #: the Events opened from its IPC handle in this process, which share it: destroyed
        #: once the last of them and the original are
        self.shares = 0
        #: made here and its handle never handed out: only aiostream records it (Waits.query)
        self.private = owned
        self.alive = True
        #: the stream aiostream last recorded it on (None: not known), and that stream's
        #: ``ops`` then: while they are unchanged, the event captures all of its work
        self.stream: Stream | None = None
        self.at = 0
        self.seq = 0  # its place among the captures of that stream
        #: the mark right after its last record (see Waits.record), which it holds
        self.mark: Any = None
        #: released by the program, but kept by the backend as its stream's last record
        #: (``Stream.recorded``), until the stream records again or goes
        self.kept = False
        #: the capture its last record went into (graphs.Capture, or FOREIGN for another
        #: library's on a stream whose handle was handed out): a point of a graph, which
        #: never completes as work; None if it was recorded outside any capture
        self.captured: Any = None

    @property
    def ptr(self) -> Any:
        """The driver's ``CUevent``, made now if it was not yet."""
        raw = self.raw
        if raw is None and self.make is not None:
            raw = self.make(self)
        return raw

    @property
    def id(self) -> int:
        return int(self.ptr)


def describe_stream(stream: Stream) -> str:
    return f"stream {stream.id} on cuda:{stream.index}"


def describe_event(event: Event) -> str:
    return f"event {event.id} on cuda:{event.index}"


class Memory:
    """Host (pinned or pageable) or device memory, and the streams that used it.

    Freeing it waits, on the device, for the work those streams had been given by then:
    the allocation stream, every stream an aiostream copy used it on, and every stream named
    with ``record_stream`` (PyTorch's caching-allocator contract).
    """

    __slots__ = (
        "__weakref__",
        "alive",
        "alloc_marker",
        "array",
        "device",
        "index",
        "nbytes",
        "pooled",
        "ptr",
        "shares",
        "streams",
    )

    def __init__(self, index: int, nbytes: int, ptr: int, *, device: bool, array: Any = None):
        self.index = index
        self.nbytes = nbytes
        self.ptr = ptr
        self.device = device
        self.array = array  # a bytearray for pageable host memory (ptr is then its address)
        self.alive = True
        #: device memory from cuMemAllocAsync (else cuMemAlloc)
        self.pooled = False
        #: the streams that used it, by key; freeing records a marker on each
        self.streams: dict[StreamKey, Stream] = {}
        #: the buffers opened from its IPC handle in this process, which share it (as
        #: Event.shares)
        self.shares = 0
        #: a stream-ordered allocation: the marker recorded after it, which another stream
        #: waits for before its first use of the memory (None once every use is ordered)
        self.alloc_marker: Any = None
