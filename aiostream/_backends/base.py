"""The backend protocol: what a device runtime gives aiostream.

Backends deal in opaque handles and plain values; they know nothing of user objects, event loops
or anyio. The user objects (``_objects.DeviceObject`` and its subclasses) hold a backend and a
handle and never branch on the backend's kind; ``_waiting`` turns :class:`WaitTarget`
completion into task wake-ups.

Handles are opaque but typed: :class:`Backend` is generic in the types of its stream, event,
memory and wait-target handles, and each backend implements it explicitly (``class
VirtualBackend(Backend[vm.Stream, vm.Event, vm.Memory, Target])``), so mypy checks every method
against the protocol. What only some backends can do is a capability protocol (:class:`Interop`,
:class:`Timeline`), also implemented explicitly; the user objects ask for the capability with
``isinstance`` (both are ``runtime_checkable``), never for the kind.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

__all__ = [
    "AnyBackend",
    "Backend",
    "Graphs",
    "Interop",
    "Timeline",
    "TimelineRecord",
    "WaitTarget",
]


class WaitTarget(Protocol):
    """The work captured by one wait: fixed when the wait starts, whatever is recorded later.

    Targets that share a ``lane`` complete in ``seq`` order (work on one stream runs in
    submission order), so a waiter that polls needs to check only the lowest pending ``seq``
    of each lane.
    """

    lane: Hashable
    seq: int

    def done(self) -> bool:
        """Return whether the captured work completed; raise ``DeviceError`` if it failed."""

    def peek(self) -> bool | None:
        """Whether the captured work has completed, if the backend can tell without a driver
        call (CUDA: a read of the completion flag the device writes for this wait's mark);
        None if it cannot. Never raises: a failed device reads as not complete, and
        :meth:`done` says why. The loop may call it on each of its turns for a short while
        before it hands the wait to :meth:`watch`."""

    def watch(self, callback: Callable[[], None], gone: Callable[[], bool] | None = None) -> None:
        """Call ``callback`` once, from any thread, when the work completes or fails or the
        backend closes (at once if it already has); :meth:`release` cancels it. The waiter
        thereby finishes just the waits that completed, never visiting the pending ones.

        ``gone``, a function (the same one for every wait of one event loop), says whether the
        loop closed with the wait pending: a backend that watches from a thread of its own
        asks it now and then, and calls back the waits whose loop is gone (their waiter then
        forgets them), so that no thread keeps watching work nobody awaits."""

    def release(self) -> None:
        """Forget the wait (idempotent); the work itself goes on, and nothing stays held for
        it (no thread, no event)."""


S = TypeVar("S")  # a stream handle
E = TypeVar("E")  # an event handle
M = TypeVar("M")  # a host or device memory handle
T = TypeVar("T", bound=WaitTarget)  # what a capture returns
E_co = TypeVar("E_co", covariant=True)


class Backend(Protocol[S, E, M, T]):
    """A device runtime: the ``virtual`` simulator or the CUDA driver."""

    kind: ClassVar[str]
    #: whether :meth:`wake_hint` gives exact completion times (virtual): the waiter then only
    #: sleeps until them; if not (CUDA), the backend learns of completions its own way and a
    #: wait's strategy says whether the loop also polls it meanwhile
    completion_times: ClassVar[bool]

    def device_count(self) -> int: ...
    def device_name(self, index: int) -> str:
        """A name for ``python -m aiostream info``: the GPU's, or what the device is."""

    def close(self) -> None: ...

    # streams
    def priority_range(self, index: int) -> tuple[int, int]:
        """(lowest, highest) priority; lower numbers are higher priorities, as in CUDA."""

    def stream_create(self, index: int, priority: int) -> S: ...
    def stream_default(self, index: int) -> S: ...
    def stream_destroy(self, stream: S) -> None: ...
    def stream_id(self, stream: S) -> int: ...
    def stream_query(self, stream: S) -> bool: ...
    def stream_wait_event(self, stream: S, event: E) -> None: ...
    def stream_target(self, stream: S, wake: bool) -> T:
        """A wait's target: the work submitted to ``stream`` so far. ``wake``: the backend is to
        learn of its completion promptly, even at some cost to the stream (a host function on
        CUDA); else it may poll for it."""

    # events
    def event_create(
        self, index: int, *, timing: bool, blocking: bool, interprocess: bool
    ) -> E: ...
    def event_destroy(self, event: E) -> None: ...
    def event_id(self, event: E) -> int: ...
    def event_record(self, event: E, stream: S) -> None: ...
    def event_query(self, event: E, quick: bool = False) -> bool:
        """Whether the work ``event`` captured completed; raise ``DeviceError`` if it failed.
        ``quick`` (an await's first look): the backend may answer from what it knows without
        a driver call, and tell a device's failure a little later (by the wait)."""

    def event_target(self, event: E, wake: bool) -> T:
        """A wait's target: the work ``event`` stood for at its last record (a later record
        does not move it; see :meth:`stream_target`)."""

    def event_elapsed_ms(self, start: E, end: E) -> float: ...
    def event_ipc_handle(self, event: E) -> bytes: ...
    def event_from_ipc_handle(self, index: int, data: bytes) -> E: ...

    # device work
    def delay(self, stream: S, seconds: float) -> None: ...

    # memory and copies; a handle freed while a copy uses it is released when the copy is done
    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> M: ...
    def host_view(self, host: M) -> memoryview:
        """The host memory, writable, for a zero-copy numpy view."""

    def host_access(self, host: M) -> None:
        """The host is about to read or write ``host`` (the virtual backend checks for races)."""

    def host_free(self, host: M) -> None: ...
    def device_alloc(self, index: int, nbytes: int, stream: S) -> M:
        """Device memory, its allocation ordered on ``stream`` (the current stream)."""

    def device_free(self, mem: M) -> None:
        """Free device memory once the work of every stream that used it (its allocation
        stream, the streams of copies, those given to :meth:`memory_use`) has completed,
        counting the work those streams had been given by the time of the free."""

    def memory_use(self, mem: M, stream: S) -> None:
        """``stream`` uses ``mem`` (``record_stream``): its first use is ordered after the
        allocation, and freeing the memory waits for its work."""

    def device_ptr(self, mem: M) -> int:
        """The device address (for ``__cuda_array_interface__``); raise where there is none."""

    def copy(self, stream: S, dst: M, src: M, nbytes: int, kind: str) -> None:
        """Enqueue a copy of ``nbytes`` on ``stream``; ``kind`` is ``h2d``, ``d2h`` or ``d2d``."""

    # sharing memory: DLPack exports and other processes
    def dlpack_device(self, index: int) -> tuple[int, int]:
        """The DLPack device ``(type, id)`` that device memory of ``index`` is exported as:
        ``(kDLCUDA, index)`` on CUDA; ``(kDLCPU, 0)`` on the simulator, whose device memory is
        host memory."""

    def memory_export(self, mem: M) -> int:
        """The address at which a DLPack consumer reads ``mem``, handed out now (the
        simulator records a race if a copy into it is in flight, as for a host view)."""

    def memory_wait(self, mem: M, stream: S) -> None:
        """Make later work on ``stream`` wait, on the device, for the work submitted so far to
        every stream that used ``mem``; never a host wait. ``stream`` does not become a user
        (its work does not hold the memory)."""

    def device_alloc_interprocess(self, index: int, nbytes: int, stream: S) -> M:
        """Device memory that :meth:`memory_ipc_handle` can share with other processes (on
        CUDA ``cuMemAlloc``'s: memory of a stream-ordered pool cannot be shared that way)."""

    def memory_ipc_handle(self, mem: M) -> bytes:
        """A handle that :meth:`memory_from_ipc_handle` opens in another process (the
        simulator: in this process only, as its events)."""

    def memory_from_ipc_handle(
        self, index: int, data: bytes, event: bytes, nbytes: int, stream: S
    ) -> M:
        """Open the memory behind ``data`` on device ``index``, not owned (freeing it closes
        it): ``stream`` waits on the device for the exporter's event (``event``, an event IPC
        handle), then holds it as its allocation stream (other streams' first use waits)."""

    # waiting
    def wake_hint(self, index: int) -> float | None:
        """Seconds after which pending work on device ``index`` may have made progress.

        ``None`` means: nothing will change until a listener given to :meth:`subscribe` is
        called (a manual clock advanced, an engine released, the backend closed, or work
        submitted that ends before the time last hinted).
        """

    def subscribe(self, index: int, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from any thread) when progress happens outside the clock's flow.

        Returns the function that unsubscribes.
        """

    def wait_blocking(self, target: T) -> None:
        """Block the calling thread until ``target`` is done (raising its error)."""


#: A backend of any kind, as the user objects and the waiters hold it: to them its handles are
#: opaque values they only pass back.
AnyBackend = Backend[Any, Any, Any, Any]


# ---------------------------------------------------------------------- capabilities


@runtime_checkable
class Interop(Protocol[S, E_co]):
    """Capability: the device's streams and events are driver objects other libraries share
    (CUDA's ``CUstream`` / ``CUevent``), so they can be wrapped and handed out as ints."""

    def stream_wrap(self, index: int, handle: int) -> tuple[S, int]:
        """A stream made elsewhere, not owned, and its priority."""

    def stream_native(self, stream: S) -> int:
        """The driver's handle of ``stream``, as an int (for ``__cuda_stream__``)."""

    def event_native(self, event: Any) -> int:
        """The driver's handle of ``event``, as an int, handed out (``Event.event_id``): others
        may record it from now on."""

    def event_wrap(self, index: int, handle: int) -> E_co:
        """An event made elsewhere, not owned."""

    def memory_wrap(self, index: int, ptr: int, nbytes: int, release: Callable[[], object]) -> Any:
        """Device memory allocated elsewhere (a DLPack producer's), not owned: ``release()``
        runs in place of a free, once the work of every stream that used it has completed
        (it must not raise)."""


@runtime_checkable
class Graphs(Protocol):
    """Capability: stream capture and graphs (CUDA's ``cuStreamBeginCapture`` ...
    ``cuGraphLaunch``; the simulator's by the same rules). What a capture does not allow
    raises :class:`aiostream.CaptureError` with the same words on every backend."""

    def capture_begin(self, stream: Any, mode: str) -> None:
        """Begin capturing ``stream``'s work (``mode``: ``"global"``, ``"thread_local"`` or
        ``"relaxed"``)."""

    def capture_end(self, stream: Any) -> Any:
        """End the capture begun on ``stream``; its streams leave it, whatever the outcome.
        The graph, ready to launch, or raise if no graph could be made."""

    def stream_capturing(self, stream: Any) -> bool:
        """Whether ``stream`` is part of a capture under way."""

    def graph_nodes(self, graph: Any) -> int:
        """How many operations the graph holds."""

    def graph_launch(self, stream: Any, graph: Any) -> None:
        """Enqueue the whole graph on ``stream``: later work on it waits for every node."""

    def graph_destroy(self, graph: Any) -> None:
        """Release the graph; launches in flight complete. Never raises."""

    def graph_handles(self, graph: Any) -> tuple[int, int]:
        """The graph's handles, as ints, for other libraries: the graph its work was taken from
        and the executable graph (CUDA's ``CUgraph`` and ``CUgraphExec``; the simulator's
        opaque ids, distinct between graphs, stable until an update)."""

    def graph_dump(self, graph: Any, path: str, verbose: bool) -> None:
        """Write a DOT description of the graph's work to ``path``: a ``digraph`` with one
        node per operation and an edge per dependency (``cuGraphDebugDotPrint`` on CUDA;
        ``verbose``: each node's parameters too)."""

    def graph_update(self, graph: Any, source: Any) -> str | None:
        """Make ``graph``'s launches run ``source``'s work from now on, in place, where the two
        have the same topology and node kinds (``cuGraphExecUpdate``); launches enqueued before
        run as they were. None once updated; else why not (``GraphUpdateError.reason``), the
        graph left as it was."""


class TimelineRecord(Protocol):
    """One completed device operation, as a :class:`Timeline` backend reports it."""

    @property
    def name(self) -> str: ...
    @property
    def device(self) -> int: ...
    @property
    def stream(self) -> int: ...
    @property
    def engine(self) -> str: ...
    @property
    def submitted(self) -> float: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def error(self) -> str | None: ...


@runtime_checkable
class Timeline(Protocol):
    """Capability: the backend keeps its own clock and a record of the device work it ran (the
    virtual simulator), so a profiler reads both instead of timing events."""

    def now(self) -> float:
        """The device clock, in seconds."""

    def timeline(self) -> Sequence[TimelineRecord]:
        """The completed operations, ordered by start."""
