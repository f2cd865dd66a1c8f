"""Graphs: device work captured once from a stream, replayed as a whole, as
``torch.cuda.CUDAGraph`` with ``torch.cuda.graph``."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from collections import deque
from typing import Any

from . import _backends, _captures, _objects
from ._backends.base import Graphs
from ._errors import AiostreamError, CaptureError, StaleHandleError, update_refused
from ._regions import record_function
from .device import Device
from .device import device as _resolve_device
from .event import Event
from .stream import Stream, current_stream, use_capture_stream

__all__ = ["CAPTURE_MODES", "Graph"]

#: ``capture_error_mode``'s values, as ``torch.cuda.graph`` names CUDA's capture modes
CAPTURE_MODES = ("thread_local", "global", "relaxed")

_names = iter(range(1, 1 << 62))
_names_lock = threading.Lock()


class Graph:
    """Device work captured once from a stream, and replayed as a whole.

    ``with g.capture() as s:`` records the work submitted to ``s`` inside the block into the
    graph instead of running it (``s`` is also the current stream there, so work submitted
    with no stream goes to it, whatever the default device). Work on other streams joins the
    capture when they wait for an event recorded on ``s`` (a fork), and must be joined back
    (``s.wait_stream(other)``) before the block ends. ``g.replay()`` then enqueues the whole
    graph on a stream, at the cost of one submission, and returns an Event recorded after it:
    ``await g.replay()`` waits for that replay. Replays may be made any number of times, from
    any task.

    What a capture does not allow raises :class:`aiostream.CaptureError` on every backend, the
    virtual devices' included, with the same words: awaiting, synchronizing or querying a
    capturing stream or an event recorded in the capture, a wait on an event recorded outside
    it, a fork not joined back, memory allocated on the capturing thread (unless
    ``capture_error_mode="relaxed"``) or on a capturing stream, a copy into pageable host
    memory. A capture left by an exception is ended and discarded; the stream is usable after.

    The buffers the captured copies use stay alive as long as the graph can run: until it is
    closed (or collected) and its last replays have completed.

    Args:
        device: where the graph's work runs; None for the default device.
        name: what the graph is, shown in profiles (its replays are spans named
            ``replay <name>``) and in pending-wait listings; a number by default.

    Example:
        >>> import anyio, aiostream as ais
        >>> async def main():
        ...     g = ais.Graph("virtual:0", name="step")
        ...     with g.capture() as s:
        ...         ais.delay(0.001, stream=s)
        ...     for _ in range(3):
        ...         await g.replay()
        ...     return g.nodes
        >>> anyio.run(main)
        1

    ``g.update(other)`` makes the replays run another capture's work of the same topology, in
    place; ``g.debug_dump(path)`` describes the graph in DOT, and ``raw_graph`` /
    ``raw_exec`` hand out its handles for other libraries.

    Note:
        Wraps ``cuStreamBeginCapture``, ``cuStreamEndCapture``, ``cuGraphInstantiate``,
        ``cuGraphLaunch``, ``cuGraphExecUpdate`` and ``cuGraphDebugDotPrint`` on CUDA.
    """

    __slots__ = (
        "__weakref__",
        "_backend",
        "_device",
        "_finalizer",
        "_handle",
        "_kept",
        "_last",
        "_lock",
        "_name",
        "_nodes",
        "_replays",
        "_state",
    )

    def __init__(self, device: Device | str | None = None, *, name: str | None = None) -> None:
        if name is not None and type(name) is not str:
            raise TypeError(f"name must be a str or None, got {name!r}")
        dev = _resolve_device(device)
        backend = _backends.get(dev.type)
        if not isinstance(backend, Graphs):
            raise AiostreamError(f"the {dev.type!r} backend has no graphs")
        if name is None:
            with _names_lock:
                name = str(next(_names))
        self._device = dev
        self._backend: Any = backend
        self._name = name
        self._handle: Any = None
        #: what the graph's copies use, kept alive while it can run (its capture's, and those
        #: of the captures it was updated from)
        self._kept: list[object] = []
        self._nodes = 0
        self._replays = 0
        self._state = "new"  # capturing, ready, failed, closed
        #: an event of aiostream's own after each replay that may still run (the program may
        #: record the one it was given elsewhere), by the replay's stream, oldest first (a
        #: stream's work completes in order): the buffers are kept until they complete
        self._last: dict[int, deque[Event]] = {}
        self._finalizer: weakref.finalize[..., Any] | None = None
        #: held by a replay from its state check to its bookkeeping, and by close: a close
        #: waits for a replay under way, and a replay after it is refused as closed
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ properties

    @property
    def device(self) -> Device:
        """The device the graph's work runs on."""
        return self._device

    @property
    def name(self) -> str:
        return self._name

    @property
    def nodes(self) -> int:
        """How many operations the graph holds (0 until it is captured)."""
        return self._nodes

    @property
    def replays(self) -> int:
        """How many times it was replayed."""
        return self._replays

    # ------------------------------------------------------------------ capture

    def capture(
        self, stream: Stream | None = None, *, capture_error_mode: str = "thread_local"
    ) -> contextlib.AbstractContextManager[Stream]:
        """Capture the work submitted to ``stream`` inside the block into this graph.

        Args:
            stream: the stream to capture; None for a new stream of the graph's device (a
                device's default stream cannot be captured).
            capture_error_mode: CUDA's capture interaction mode: ``"thread_local"`` (the
                default: only this thread is held to the capture's rules, so other threads
                and libraries go on unaffected), ``"global"`` (``torch.cuda.graph``'s
                default: other threads in global mode are held to them too) or
                ``"relaxed"`` (no thread is).

        Yields:
            The capturing stream, current inside the block (``current_stream()`` with no
            device is it there too).

        Raises:
            CaptureError: the graph was captured already, the stream is capturing, or the
                capture could not make a graph (the block's work broke a rule); or the block
                is left on another thread than the one that entered it (nothing is ended
                then: the capture goes on, and its own thread leaves the block).
        """
        return _Capture(self, stream, capture_error_mode)

    def _begin(self, stream: Stream | None, capture_error_mode: str) -> _Begun:
        """What entering ``capture``'s block does: the capture begun, and its stream current."""
        if type(capture_error_mode) is not str:
            raise TypeError(f"capture_error_mode must be a str, got {capture_error_mode!r}")
        if capture_error_mode not in CAPTURE_MODES:
            raise ValueError(
                f"capture_error_mode must be one of {', '.join(map(repr, CAPTURE_MODES))}, "
                f"got {capture_error_mode!r}"
            )
        if self._state != "new":
            raise CaptureError(
                f"graph {self._name!r} was captured already ({self._state}): a graph is "
                "captured once; make a new Graph to capture again"
            )
        if stream is None:
            stream = Stream(self._device, name=f"graph {self._name} capture")
        elif not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream or None, got {stream!r}")
        elif stream.device != self._device:
            raise ValueError(
                f"graph {self._name!r} is on {self._device}, but the stream is on "
                f"{stream.device}: capture a stream of the graph's device"
            )
        if _objects.backend(stream) is not self._backend:
            _objects.check_same_backend(
                stream, _objects.unowned(Stream, self._device, self._backend, None)
            )
        backend, handle = self._backend, _objects.handle(stream)
        where = (self._device.type, self._device.index)
        kept = _captures.begin(where, capture_error_mode)
        try:
            backend.capture_begin(handle, capture_error_mode)
        except BaseException:
            _captures.end(where, capture_error_mode, kept)
            raise
        self._state = "capturing"
        begun = _Begun(stream, handle, where, capture_error_mode, kept)
        try:
            begun.scope.enter_context(record_function(f"capture {self._name}"))
            begun.scope.enter_context(use_capture_stream(stream))
        except BaseException as exc:
            self._end(begun, exc)
            raise
        return begun

    def _end(self, begun: _Begun, exc: BaseException | None) -> None:
        """What leaving ``capture``'s block does (on the thread that entered it), ``exc``
        the exception that left it: the capture ended, and its graph made or discarded."""
        backend, handle = self._backend, begun.handle
        failure = exc is not None
        graph: Any = None
        try:
            try:
                if exc is None:
                    begun.scope.close()
                else:
                    begun.scope.__exit__(type(exc), exc, exc.__traceback__)
            except BaseException:
                failure = True
                raise
            finally:
                if failure:
                    self._state = "failed"
                    with contextlib.suppress(AiostreamError):  # ended and discarded: what
                        backend.graph_destroy(backend.capture_end(handle))  # broke is told
            if not failure:
                try:
                    graph = backend.capture_end(handle)
                except BaseException:
                    self._state = "failed"
                    raise
        finally:
            _captures.end(begun.where, begun.mode, begun.kept)
        if failure:
            return
        kept = begun.kept
        with self._lock:
            self._handle = graph
            self._kept = kept
            self._nodes = backend.graph_nodes(graph)
            self._state = "ready"
            self._finalizer = weakref.finalize(self, _retire, backend, graph, kept, self._last)
            self._finalizer.atexit = False  # the backend's close at exit releases what it must
        if not self._nodes:
            warnings.warn(
                f"the capture of graph {self._name!r} recorded no work, so its replays do "
                "nothing: was the work submitted to another stream than the capturing one (the "
                "with block's, current inside it), or to another device, instead of to it?",
                UserWarning,
                stacklevel=3,  # the with statement's line
            )

    # ------------------------------------------------------------------ interop

    @property
    def raw_graph(self) -> int:
        """The graph whose work the replays run, as an int, for other libraries: on CUDA the
        ``CUgraph`` (torch's ``raw_cuda_graph()``), its capture's or, once updated, the
        capture's it was updated from; on a virtual device an opaque id (no driver handle),
        distinct between captures. Valid until the graph is closed: aiostream destroys it.

        Raises:
            AiostreamError: the graph was never captured, its capture failed, or it was
                closed (``CaptureError`` while its capture is under way).
        """
        return self._handles()[0]

    @property
    def raw_exec(self) -> int:
        """The executable graph that replays launch, as an int: on CUDA the ``CUgraphExec``
        (torch's ``raw_cuda_graph_exec()``), the same after an update; on a virtual device an
        opaque id, distinct between graphs. Valid until the graph is closed. A launch made
        with it elsewhere is not ordered after the allocation of the device buffers the graph
        uses, as a replay is: await a replay (or the buffers' work) before it.

        Raises:
            AiostreamError: as :attr:`raw_graph`.
        """
        return self._handles()[1]

    def _handles(self) -> tuple[int, int]:
        with self._lock:  # not closed meanwhile
            if self._state != "ready":
                raise self._not_ready("handles")
            handles: tuple[int, int] = self._backend.graph_handles(self._handle)
            return handles

    def debug_dump(self, path: str | os.PathLike[str], *, verbose: bool = False) -> None:
        """Write a description of the graph's work to ``path`` in Graphviz's DOT language (as
        ``torch.cuda.CUDAGraph.debug_dump``): a ``digraph`` with one node per operation
        (labelled with its index and kind: ``KERNEL``, ``MEMCPY``...) and an edge per
        dependency (``dot -Tsvg`` draws it). ``verbose``: each node's parameters too.

        Raises:
            AiostreamError: as :attr:`raw_graph`.
            OSError: the file cannot be written.

        Note:
            Wraps ``cuGraphDebugDotPrint`` on CUDA; a virtual device writes its own nodes in
            the same shape.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or an os.PathLike, got {path!r}")
        path = os.fspath(path)
        if not isinstance(path, str):
            raise TypeError(f"path must name a file with a str, got {path!r}")
        if type(verbose) is not bool:
            raise TypeError(f"verbose must be a bool, got {verbose!r}")
        with self._lock:  # not closed meanwhile
            if self._state != "ready":
                raise self._not_ready("dump")
            with open(path, "w", encoding="utf-8"):  # writable: OSError here, on every backend
                pass
            self._backend.graph_dump(self._handle, path, verbose)

    # ------------------------------------------------------------------ update

    def update(self, other: Graph) -> None:
        """Make this graph's replays run ``other``'s work from now on, in place: the
        executable graph takes the parameters of ``other``'s operations (their buffers, a
        kernel's duration), where ``other`` was captured with the same topology (as
        ``cuGraphExecUpdate``; cuda.core's and CUDA.jl's ``update``). Cheaper than a new
        graph's instantiation on a GPU; replays enqueued before run as they were. ``other``
        stays usable (close it when done with it); this graph keeps the buffers ``other``'s
        copies use alive as its own, until it is closed.

        Raises:
            GraphUpdateError: ``other``'s work differs in topology (the number of operations
                or their dependencies), in an operation's kind, or in parameters the driver
                cannot change in place; this graph is left as it was and still replays its
                own work (replay ``other`` instead, or capture the new work into a new Graph).
            AiostreamError: either graph was never captured, its capture failed, or it was
                closed (``CaptureError`` while its capture is under way).
            ValueError: ``other`` is on another device, or is this graph.
            StaleHandleError: the graphs belong to two instances of a virtual backend (it
                was reset between their captures).

        Note:
            Wraps ``cuGraphExecUpdate`` on CUDA.
        """
        if not isinstance(other, Graph):
            raise TypeError(f"other must be an aiostream.Graph, got {other!r}")
        if other is self:
            raise ValueError(f"graph {self._name!r} cannot be updated from itself")
        if other._device != self._device:
            raise ValueError(
                f"graph {self._name!r} is on {self._device} and cannot be updated from graph "
                f"{other._name!r}, captured on {other._device}: update it from a capture of "
                "its own device"
            )
        first, second = self._lock, other._lock
        if id(first) > id(second):  # one order: no deadlock between two updating each other
            first, second = second, first
        with first, second:  # neither closed, replayed or updated meanwhile
            if self._state != "ready":
                raise self._not_ready("update")
            if other._state != "ready":
                raise other._not_ready("update")
            if other._backend is not self._backend:
                raise StaleHandleError(
                    f"graphs {self._name!r} and {other._name!r} come from two instances of "
                    "one backend: it was replaced between their captures (for the virtual "
                    "backend, aiostream.virtual.reset() ran); capture them again after it"
                )
            reason = self._backend.graph_update(self._handle, other._handle)
            if reason is not None:
                raise update_refused(self._name, other._name, reason)
            # the copies now launched use other's buffers; this graph's own are let go once
            # the replays enqueued before the update, which use them, have completed
            theirs = {id(b) for b in other._kept}
            ours = [b for b in self._kept if id(b) not in theirs]
            self._kept[:] = other._kept  # in place: the finalizer holds this list
            _let_go_after_replays(ours, self._last)

    # ------------------------------------------------------------------ replay

    def replay(self, stream: Stream | None = None) -> Event:
        """Enqueue the whole graph on ``stream`` (the current stream of the graph's device
        when None): later work on it waits for every node. Returns an Event recorded right
        after the replay: ``await g.replay()`` waits for this replay only.

        Raises:
            AiostreamError: the graph was never captured, its capture failed, or it was
                closed (``CaptureError`` while its capture is under way); nothing is enqueued.
            ValueError: ``stream`` is on another device.
            StaleHandleError: the graph's virtual backend was reset since its capture.

        Note:
            Wraps ``cuGraphLaunch`` on CUDA.
        """
        with self._lock:  # not closed from its state check to its bookkeeping
            return self._replay(stream)

    def _replay(self, stream: Stream | None) -> Event:
        if self._state != "ready":
            raise self._not_ready()
        if stream is None:
            stream = current_stream(self._device)
        elif not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream or None, got {stream!r}")
        if stream.device != self._device:
            raise ValueError(
                f"graph {self._name!r} was captured on {self._device} and cannot be replayed "
                f"on a stream of {stream.device}: replay it on a stream of its own device"
            )
        backend = self._backend
        if _objects.backend(stream) is not backend:
            _objects.check_same_backend(
                stream, _objects.unowned(Stream, self._device, backend, None)
            )
        name = f"replay {self._name}"
        with record_function(name, stream=stream, graph=self._name, nodes=self._nodes):
            _objects.submit(stream, name, backend.graph_launch, self._handle)
        self._replays += 1
        event = Event(self._device)
        event.record(stream)
        event._label = f"replay {self._replays} of graph {self._name!r}"  # noqa: SLF001
        trackers = self._last.get(stream.stream_id)
        if trackers is None:
            trackers = self._last[stream.stream_id] = deque()
        elif len(trackers) >= _PRUNE_AT:  # the stream's oldest, forgotten once complete:
            while trackers and _done(trackers[0]):  # a look at the oldest pending only
                trackers.popleft()
        trackers.append(stream.record_event())
        return event

    def _not_ready(self, action: str = "replay") -> AiostreamError:
        """Why the graph, not ready, refuses ``action`` (a key of ``_ACTIONS``)."""
        doing, verb, done = _ACTIONS[action]
        name = repr(self._name)
        if self._state == "new":
            return AiostreamError(
                f"graph {name} has not been captured: capture work into it first "
                "(with g.capture() as s: ...)"
            )
        if self._state == "capturing":
            return CaptureError(
                f"graph {name} is being captured: leave its capture's with block before {doing}"
            )
        if self._state == "failed":
            return AiostreamError(
                f"the capture of graph {name} failed (its error was raised then), so there is "
                f"nothing to {verb}: make a new Graph and capture again"
            )
        return AiostreamError(f"graph {name} was closed: it can no longer be {done}")

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Release the graph (idempotent). Replays in flight complete; the buffers its copies
        use are let go once they have. A replay under way on another thread is waited for."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            if self._state != "failed":
                self._state = "closed"

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<aiostream.Graph {self._name!r} device={self._device} state={self._state} "
            f"nodes={self._nodes} replays={self._replays}>"
        )


class _Begun:
    """A capture begun by :meth:`Graph.capture`'s block: what leaving it ends."""

    __slots__ = ("handle", "kept", "mode", "scope", "stream", "thread", "where")

    def __init__(
        self, stream: Stream, handle: Any, where: tuple[str, int], mode: str, kept: list[object]
    ) -> None:
        self.stream = stream
        self.handle = handle
        self.where = where
        self.mode = mode
        self.kept = kept
        self.thread = threading.get_ident()
        #: what the block entered (its profile range, its current stream): left at its end
        self.scope = contextlib.ExitStack()


class _Capture:
    """The block of :meth:`Graph.capture`: begins the capture when entered, ends it when left
    on the same thread; left on another, it raises and the capture goes on."""

    __slots__ = ("_begun", "_graph", "_mode", "_stream")

    def __init__(self, graph: Graph, stream: Stream | None, mode: str) -> None:
        self._graph = graph
        self._stream = stream
        self._mode = mode
        self._begun: _Begun | None = None

    def __enter__(self) -> Stream:
        begun = self._graph._begin(self._stream, self._mode)  # noqa: SLF001 - its own block
        self._begun = begun
        return begun.stream

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        begun = self._begun
        if begun is None:
            return
        if threading.get_ident() != begun.thread:  # before anything: the capture goes on
            raise CaptureError(
                f"the capture of graph {self._graph.name!r} was left on another thread than "
                "the one that began it: the driver ends a capture on its own thread, so leave "
                "the with block there (the capture goes on)"
            )
        self._begun = None
        self._graph._end(begun, exc)  # noqa: SLF001 - its own block


def _retire(backend: Any, graph: Any, kept: list[object], last: dict[int, deque[Event]]) -> None:
    """Release ``graph``; let go of what its copies use once its last replays completed."""
    backend.graph_destroy(graph)
    _let_go_after_replays(kept, last)
    last.clear()


def _let_go_after_replays(kept: list[object], last: dict[int, deque[Event]]) -> None:
    """Let go of ``kept`` (the buffers copies use) once the replays tracked in ``last``, which
    may use them, have completed: at once if none is pending."""
    pending = [e for trackers in last.values() for e in trackers if not _done(e)]
    if not pending:
        kept.clear()
        return
    left = [len(pending)]
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        _held.pop(id(kept), None)
        kept.clear()

    _held[id(kept)] = kept  # alive until the replays complete
    for event in pending:
        try:
            _objects.when_done(event, one_done)
        except AiostreamError:  # failed, or its backend closed, since: it runs no more
            one_done()


def _done(event: Event) -> bool:
    try:
        return event.query()
    except AiostreamError:  # failed, or its backend closed: it runs no more
        return True


#: what a graph not ready says it cannot do, by action: (doing it, to do it, done)
_ACTIONS = {
    "replay": ("replaying it", "replay", "replayed"),
    "handles": ("asking for its handles", "hand out", "asked for its handles"),
    "dump": ("describing it", "describe", "described"),
    "update": ("updating it or another from it", "update", "updated or update another"),
}
#: what retired graphs keep alive until their last replays complete
_held: dict[int, list[object]] = {}
#: how many replay trackers a graph keeps on a stream before it forgets those complete
_PRUNE_AT = 64
