"""Streams: ordered queues of device work, and the task-local current stream."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from . import _backends, _check, _objects
from ._backends.base import Interop
from .device import Device
from .device import device as _resolve_device

if TYPE_CHECKING:
    from ._backends.base import AnyBackend, WaitTarget
    from .event import Event

__all__ = [
    "ExternalStream",
    "Stream",
    "current_stream",
    "default_stream",
    "delay",
    "is_current_stream_capturing",
    "use_stream",
]


class Stream(_objects.Awaitable):
    """An ordered queue of device work, as ``torch.Stream`` / ``torch.cuda.Stream``.

    Work submitted to one stream runs in submission order; work on different streams may
    overlap. ``await stream.synchronize()`` suspends only the calling task.

    Args:
        device: where the stream lives (see :func:`aiostream.device`); None for the default.
        priority: lower numbers are higher priorities, as in CUDA; 0 (the lowest) by default.
            The valid range depends on the device (``-5`` to ``0`` on virtual devices).
        name: what the stream is for (``"compute"``, ``"h2d copies"``), shown in its repr
            and in profiles' traces and timelines; None for none.

    Example:
        >>> s = Stream("virtual:0")
        >>> s.query()
        True

    Note:
        Wraps ``cuStreamCreateWithPriority`` on CUDA.
    """

    __slots__ = ("_id", "_name", "_priority")

    _what = "stream"
    _id: int
    _priority: int
    _name: str | None

    def __init__(
        self, device: Device | str | None = None, *, priority: int = 0, name: str | None = None
    ) -> None:
        if name is not None and type(name) is not str:
            raise TypeError(f"name must be a str or None, got {name!r}")
        dev = _resolve_device(device)
        backend = _backends.get(dev.type)
        priority = _check.integer(priority, "priority")
        lowest, highest = backend.priority_range(dev.index)
        if not highest <= priority <= lowest:
            raise ValueError(
                f"priority must be between {highest} (highest) and {lowest} (lowest) on {dev}, "
                f"got {priority}"
            )
        handle = backend.stream_create(dev.index, priority)
        self._bind(dev, backend, handle, backend.stream_destroy)
        self._priority = priority
        self._id = backend.stream_id(handle)
        self._name = name
        if name is not None:
            _named[dev, self._id] = self

    @classmethod
    def _unowned(cls, backend: AnyBackend, dev: Device, handle: Any, priority: int = 0) -> Stream:
        """A Stream over a handle it does not own (the default stream, external streams)."""
        self = _objects.unowned(cls, dev, backend, handle)
        self._priority = priority
        self._id = backend.stream_id(handle)
        self._name = None
        return self

    # ------------------------------------------------------------------ properties

    @property
    def device_type(self) -> str:
        """The device's kind: ``"virtual"`` or ``"cuda"``."""
        return self._device.type

    @property
    def device_index(self) -> int:
        """The device's index."""
        return self._device.index

    @property
    def stream_id(self) -> int:
        """An id unique among the live streams of the device; 0 is the default stream."""
        return self._id

    @property
    def priority(self) -> int:
        """The stream's priority (lower is higher)."""
        return self._priority

    @property
    def name(self) -> str | None:
        """What the stream is for, as given when it was made; None if not named."""
        return self._name

    # ------------------------------------------------------------------ work

    def query(self) -> bool:
        """Return whether all work submitted so far has completed. Never blocks.

        Note:
            Wraps ``cuStreamQuery`` on CUDA.
        """
        return self._backend.stream_query(self._handle)

    def is_capturing(self) -> bool:
        """Return whether the stream is part of a graph capture under way: the stream of a
        ``Graph.capture()`` block, a stream that joined it (a fork), or, for a stream whose
        handle was handed out or made elsewhere, another library's capture (PyTorch's
        ``torch.cuda.graph``). Never blocks, and never breaks a capture.

        Note:
            Asks ``cuStreamIsCapturing`` on CUDA where aiostream cannot tell alone.
        """
        return _objects.capturing(self)

    def _target(self, wake: bool) -> WaitTarget:
        target: WaitTarget = self._backend.stream_target(self._handle, wake)
        return target

    def _subject(self) -> str:
        return f"stream {self._id}"

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` on the device; the host does not wait.

        An event never recorded is complete, so waiting for it does nothing.

        Note:
            Wraps ``cuStreamWaitEvent`` on CUDA.
        """
        from .event import Event

        if not isinstance(event, Event):
            raise TypeError(f"event must be an aiostream.Event, got {event!r}")
        _objects.check_same_backend(self, event)
        event_handle = _objects.handle(event)
        if event_handle is not None:
            self._backend.stream_wait_event(self._handle, event_handle)

    def wait_stream(self, stream: Stream) -> None:
        """Make later work on this stream wait for the work submitted to ``stream`` so far."""
        if not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream, got {stream!r}")
        _objects.check_same_backend(self, stream)
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) on this stream and return it."""
        from .event import Event

        if event is None:
            event = Event(self._device)
        elif not isinstance(event, Event):
            raise TypeError(f"event must be an aiostream.Event or None, got {event!r}")
        event.record(self)
        return event

    # ------------------------------------------------------------------ interop

    def __cuda_stream__(self) -> tuple[int, int]:
        """``(0, handle)``: the CUDA stream interop protocol (as in cuda-python's cuda.core).

        Lets libraries that accept ``__cuda_stream__`` objects run their work on this stream.

        Raises:
            TypeError: the stream is not on a CUDA device.
        """
        backend = self._backend
        if not isinstance(backend, Interop):
            raise TypeError(f"{self!r} is not a CUDA stream, so it has no CUDA handle")
        return (0, backend.stream_native(self._handle))

    # ------------------------------------------------------------------ identity

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        return self._device == other._device and self._id == other._id

    def __hash__(self) -> int:
        return hash((self._device, self._id))

    def __repr__(self) -> str:
        named = "" if self._name is None else f" name={self._name!r}"
        return (
            f"<aiostream.Stream device={self._device} id={self._id} priority={self._priority}"
            f"{named}>"
        )


class ExternalStream(Stream):
    """A CUDA stream made elsewhere (PyTorch, CuPy, a C library), wrapped without owning it.

    aiostream never destroys it: keep the stream alive in its owner while this object is used.
    Its ``stream_id`` is the handle, so two wrappers of one stream compare equal.

    Args:
        stream_ptr: the ``CUstream`` handle, as an int (0 is the default stream).
        device: the CUDA device the stream belongs to; None for ``cuda:0``.

    Example:
        >>> s = ExternalStream(torch.cuda.current_stream().cuda_stream)  # doctest: +SKIP
    """

    __slots__ = ()

    def __init__(self, stream_ptr: int, device: Device | str | None = None) -> None:
        stream_ptr = _check.handle(stream_ptr, "stream_ptr", what="an int (a CUstream handle)")
        dev = _resolve_device("cuda:0" if device is None else device)
        backend = _backends.get(dev.type)
        if not isinstance(backend, Interop):
            raise ValueError(f"ExternalStream wraps CUDA streams; device must be cuda:N, got {dev}")
        handle, priority = backend.stream_wrap(dev.index, stream_ptr)
        self._bind(dev, backend, handle, None)  # not owned: never destroyed
        self._priority = priority
        self._id = backend.stream_id(handle)

    def __repr__(self) -> str:
        return f"<aiostream.ExternalStream device={self._device} handle={self._id:#x}>"


#: the live streams that have a name, by device and id (ids are unique among live streams)
_named: weakref.WeakValueDictionary[tuple[Device, int], Stream] = weakref.WeakValueDictionary()


def stream_name(device: Device, stream_id: int) -> str | None:
    """The name of the live stream ``stream_id`` of ``device``; None if it has none."""
    stream = _named.get((device, stream_id))
    return None if stream is None else stream.name


# ---------------------------------------------------------------------- default and current

#: each kind's backend in use and its devices' default streams. One backend per kind: the
#: one a reset or a close replaced is dropped with its streams here (a weak mapping keyed by
#: the backend would keep it forever, as each stream holds its backend).
_defaults: dict[str, tuple[AnyBackend, dict[int, Stream]]] = {}
_defaults_lock = threading.Lock()
_current: contextvars.ContextVar[Mapping[Device, Stream]] = contextvars.ContextVar(
    "aiostream_current_stream", default=MappingProxyType({})
)

#: the device whose current stream work with no stream and no device goes to: a graph
#: capture's inside its block (``use_capture_stream``), else None (the default device)
_work_device: contextvars.ContextVar[Device | None] = contextvars.ContextVar(
    "aiostream_work_device", default=None
)


def default_stream(device: Device | str | None = None) -> Stream:
    """Return the default stream of ``device`` (the default device when None).

    Note:
        On CUDA this is the legacy default stream (handle 0) of the device's primary context.
    """
    dev = _resolve_device(device)
    backend = _backends.get(dev.type)
    entry = _defaults.get(dev.type)
    if entry is None or entry[0] is not backend:
        with _defaults_lock:  # two threads asking at once share one Stream object
            entry = _defaults.get(dev.type)
            if entry is None or entry[0] is not backend:
                entry = _defaults[dev.type] = (backend, {})
    per_device = entry[1]
    stream = per_device.get(dev.index)
    if stream is None:
        handle = backend.stream_default(dev.index)
        default = Stream._unowned(backend, dev, handle)  # noqa: SLF001 (this module's)
        stream = per_device.setdefault(dev.index, default)
    return stream


def current_stream(device: Device | str | None = None) -> Stream:
    """Return the current task's stream on ``device``: set by :func:`use_stream`, else the
    default. With no device: inside a graph's capture block, the capturing stream (whatever
    the default device); else the default device's."""
    if device is None:
        device = _work_device.get()
    dev = _resolve_device(device)
    stream = _current.get().get(dev)
    if stream is not None and _objects.backend(stream) is _backends.get(dev.type):
        return stream
    return default_stream(dev)


def is_current_stream_capturing(device: Device | str | None = None) -> bool:
    """Return whether the current stream (see :func:`current_stream`: inside a graph's capture
    block with no device, the capturing stream) is part of a graph capture under way, as
    ``torch.cuda.is_current_stream_capturing()``: work submitted to it now would be recorded
    into a graph, not run."""
    return current_stream(device).is_capturing()


def stream_or_current(stream: Stream | None, device: Device | str | None = None) -> Stream:
    """``stream`` itself (checked), or the current stream of ``device`` when it is None."""
    if stream is None:
        return current_stream(device)
    if not isinstance(stream, Stream):
        raise TypeError(f"stream must be an aiostream.Stream or None, got {stream!r}")
    return stream


@contextlib.contextmanager
def use_stream(stream: Stream) -> Iterator[Stream]:
    """Make ``stream`` the current stream of its device, for the current task only.

    The setting lives in a context variable: tasks started inside the block inherit it, and
    concurrent tasks each see their own.

    Example:
        >>> s = Stream("virtual:0")
        >>> with use_stream(s):
        ...     assert current_stream("virtual:0") is s
    """
    if not isinstance(stream, Stream):
        raise TypeError(f"use_stream() needs an aiostream.Stream, got {stream!r}")
    streams = dict(_current.get())
    streams[stream.device] = stream
    token = _current.set(MappingProxyType(streams))
    try:
        yield stream
    finally:
        _current.reset(token)


@contextlib.contextmanager
def use_capture_stream(stream: Stream) -> Iterator[Stream]:
    """:func:`use_stream`, and ``stream``'s device the one that work with no stream and no
    device goes to: a graph capture's block (aiostream's own, not exported)."""
    token = _work_device.set(stream.device)
    try:
        with use_stream(stream):
            yield stream
    finally:
        _work_device.reset(token)


def delay(seconds: float, *, stream: Stream | None = None) -> None:
    """Enqueue device work that takes ``seconds`` on ``stream`` (the current stream when None).

    The virtual backend simulates it; on CUDA it runs a sleep kernel.

    Note:
        On CUDA the first call for a device loads the sleep kernel's module
        (``cuModuleLoadData``), which on a GPU waits for the work already submitted to the
        device's streams: make that first call before holding a stream's work indefinitely
        (a stream memory wait), as ``ais.delay(0)`` does.

    Raises:
        TypeError: ``seconds`` is not a number, or ``stream`` not a Stream.
        ValueError: ``seconds`` is negative or not finite.
    """
    seconds = _check.seconds(seconds, "seconds")
    stream = stream_or_current(stream)
    _objects.submit(stream, "delay", _objects.backend(stream).delay, seconds)
