"""The base of the objects users hold on a device: :class:`DeviceObject`.

``Stream``, ``Event``, ``HostBuffer`` and ``DeviceBuffer`` are each a device, the backend of its
kind, and that backend's opaque handle. This module owns those three attributes: the user
objects set them through :meth:`DeviceObject._bind` and read their own; where one object needs
another's handle (an event recorded on a stream, a copy between buffers) it goes through the
functions below, never through another module's private attribute (ruff's SLF001 holds every
other module to that).

The await sequence shared by streams and events lives here too (:class:`Awaitable`): a fast
path that costs one checkpoint when the work is already complete, else a capture handed to
``_waiting``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from . import _captures, _diagnostics, _hooks, _waiting
from ._errors import StaleHandleError

if TYPE_CHECKING:
    from ._backends.base import AnyBackend, WaitTarget
    from .device import Device

__all__ = [
    "Awaitable",
    "DeviceObject",
    "backend",
    "capturing",
    "check_same_backend",
    "handle",
    "note_submission",
    "submit",
    "unowned",
    "when_done",
]

D = TypeVar("D", bound="DeviceObject")


def _finalizer(
    obj: object, release: Callable[[Any], object], handle: Any
) -> weakref.finalize[..., Any]:
    """``release(handle)`` once ``obj`` is collected, but not at exit, as ``weakref.finalize``
    would by default: that runs before the atexit handlers registered earlier than the first
    finalizer, which would then read freed memory through the host views the program still
    holds. The backend's own close at exit releases what must be."""
    finalizer = weakref.finalize(obj, release, handle)
    finalizer.atexit = False
    return finalizer


class DeviceObject:
    """A device, its backend, and the backend's handle of the thing itself."""

    __slots__ = ("__weakref__", "_backend", "_device", "_finalizer", "_handle", "_origin")

    _backend: AnyBackend
    _device: Device
    _handle: Any
    _finalizer: weakref.finalize[..., Any] | None
    #: where work was last submitted or recorded (debug mode), for the pending-wait listing
    _origin: _diagnostics.Origin | None

    def _bind(
        self,
        device: Device,
        backend: AnyBackend,
        handle: Any,
        release: Callable[[Any], object] | None,
    ) -> None:
        """Set the three attributes; ``release(handle)`` runs when the object is collected
        (None: the handle is not owned, and never released here)."""
        self._device = device
        self._backend = backend
        self._handle = handle
        self._origin = None
        self._finalizer = None if release is None else _finalizer(self, release, handle)

    def _adopt(self, handle: Any, release: Callable[[Any], object]) -> None:
        """Take ``handle`` on an object bound without one (an event before its first record)."""
        self._handle = handle
        self._finalizer = _finalizer(self, release, handle)

    @property
    def device(self) -> Device:
        """The device this object belongs to."""
        return self._device


class Awaitable(DeviceObject):
    """A device object whose work can be awaited: a stream (all its work so far) or an event
    (the work it captured)."""

    __slots__ = ()

    #: what it is, for messages: "stream" or "event"
    _what: ClassVar[str]

    def query(self) -> bool:
        """Whether the work completed already; never blocks (raises the device's error if it
        failed)."""
        raise NotImplementedError

    def _ready(self) -> bool:
        """An await's first look: :meth:`query`, or what the backend can tell of it without a
        driver call (``event_query(quick=True)``)."""
        return self.query()

    def _target(self, wake: bool) -> WaitTarget:
        """The work to wait for, fixed now; ``wake``: the backend is to learn of its completion
        promptly (see ``Backend.stream_target``)."""
        raise NotImplementedError

    def _subject(self) -> str:
        """What a pending-wait listing calls this wait."""
        raise NotImplementedError

    async def synchronize(self, *, strategy: str | None = None) -> None:
        """Suspend the calling task until the work completes: for a stream, all work submitted
        to it so far; for an event, the work it captured.

        Raises ``DeviceError`` if that work failed. Cancelling it (or a timeout around it)
        removes the wait and leaks nothing; the device work goes on.

        Args:
            strategy: how a CUDA wait is watched, for this call only: ``"quiet"``,
                ``"hybrid"``, ``"poll"``, ``"thread"`` or ``"callback"`` (see
                :func:`aiostream.set_wait_strategy`).

        Note:
            On CUDA this is ``cuStreamQuery`` / ``cuEventQuery``, then a wait for a value the
            device writes after the work (``cuStreamWriteValue32``); the event loop never
            blocks.
        """
        if strategy is not None:
            _waiting.check_strategy(strategy)
        if self._ready():
            if not _hooks.listeners:
                await _waiting.checkpoint()
            else:
                await _waiting.observed(self._subject(), str(self._device))
            return
        if strategy is None:
            strategy = _waiting.get_wait_strategy()
        target = self._target(strategy in _waiting.WAKE)
        entry = _waiting.begin(
            self._backend, self._device.index, target, self, self._origin, strategy, _described
        )
        if entry is None:  # listeners: told of the wait
            await _waiting.wait(
                self._backend, self._device.index, target, self, self._origin, strategy, _described
            )
            return
        # the wait is held in this frame: one coroutine less per pending wait
        try:
            await _waiting.parked(entry)
        except BaseException:
            _waiting.cancelled(entry)
            raise
        finally:
            _waiting.end(entry)
        error = _waiting.failure(entry)
        if error is not None:
            # a program may keep the error: its traceback holds this frame, which must not
            # hold the wait's entry (and through it the waiter and every wait it lists)
            del entry, target
            raise error

    def __await__(self) -> Generator[Any, Any, None]:
        """``await x`` is ``await x.synchronize()``, with the default wait strategy."""
        # a generator: the coroutine is made only when awaited, never left unawaited
        return (yield from self.synchronize().__await__())

    def synchronize_blocking(self) -> None:
        """Block the calling thread until the work completes.

        For threads that run no event loop; in a loop's thread it raises instead of blocking.

        Note:
            On CUDA the thread waits for the device's watcher, as awaits do (woken by a host
            function under the ``"hybrid"`` and ``"callback"`` strategies only), in short
            timed waits: Ctrl-C reaches the main thread meanwhile.
        """
        if self.query():
            return
        wake = _waiting.get_wait_strategy() in _waiting.WAKE
        _waiting.wait_blocking(self._backend, self._target(wake), self._what)


def _described(obj: Awaitable) -> str:
    """What a pending-wait listing calls a wait on ``obj``, worded when someone looks."""
    return obj._subject()  # noqa: SLF001 (this module owns the method)


def handle(obj: DeviceObject) -> Any:
    """The backend's handle of ``obj`` (None for an event never recorded)."""
    return obj._handle  # noqa: SLF001 (this module owns the attribute)


def backend(obj: DeviceObject) -> AnyBackend:
    """The backend ``obj`` belongs to."""
    return obj._backend  # noqa: SLF001


def submit(stream: DeviceObject, what: str, fn: Callable[..., None], *args: Any) -> None:
    """Submit work to ``stream``: ``fn(stream's handle, *args)``, noting where it was submitted
    (debug mode), the listeners told as ``what`` right before and right after (the profiler's
    marks bracket it on the stream, in submission order)."""
    if _diagnostics.debug:
        note_submission(stream)
    if not _hooks.listeners or not _hooks.wanted("submit"):  # the common case
        fn(stream._handle, *args)  # noqa: SLF001
        return
    device = stream._device  # noqa: SLF001
    if _captures.under_way((device.type, device.index)) and capturing(stream):
        fn(stream._handle, *args)  # noqa: SLF001 - a node of a graph: nothing to time now
        return
    told = _hooks.submit_began(what, stream)
    try:
        fn(stream._handle, *args)  # noqa: SLF001
    finally:
        _hooks.submit_ended(told)


def when_done(obj: Awaitable, callback: Callable[[], None]) -> None:
    """Call ``callback`` once, from any thread, when the work ``obj`` captures now has
    completed or failed, or its backend closed (at once if it has); nothing stays held for
    it after."""
    target = obj._target(False)  # noqa: SLF001

    def fire() -> None:
        target.release()  # backends call a watch's callback with none of their locks' lists
        callback()

    target.watch(fire)


def capturing(stream: DeviceObject) -> bool:
    """Whether ``stream`` is part of a graph capture under way."""
    probe = getattr(stream._backend, "stream_capturing", None)  # noqa: SLF001
    return bool(probe is not None and probe(stream._handle))  # noqa: SLF001


def note_submission(stream: DeviceObject) -> _diagnostics.Origin | None:
    """Remember, on ``stream``, where work is being submitted to it now (debug mode), for the
    pending-wait listing; return it."""
    origin = stream._origin = _diagnostics.capture()  # noqa: SLF001
    return origin


def unowned(cls: type[D], device: Device, backend: AnyBackend, handle: Any) -> D:
    """A ``cls`` over a handle made elsewhere (a default or foreign stream, a foreign event),
    never released here. The caller sets the class's own attributes."""
    obj = cls.__new__(cls)
    obj._bind(device, backend, handle, None)  # noqa: SLF001
    return obj


def check_same_backend(a: DeviceObject, b: DeviceObject) -> None:
    """Refuse to mix objects of two backends (two kinds, or two instances of one kind, as after
    ``aiostream.virtual.reset()``): a handle means something only to its own backend."""
    ba, bb = a._backend, b._backend  # noqa: SLF001
    if ba is bb:
        return
    pair = f"{type(a).__name__} on {a._device} and {type(b).__name__} on {b._device}"  # noqa: SLF001
    if type(ba) is not type(bb):
        raise ValueError(f"{pair} belong to different backends")
    raise StaleHandleError(
        f"{pair} come from two instances of one backend: it was replaced between them (for "
        "the virtual backend, aiostream.virtual.reset() ran); create them again after it"
    )
