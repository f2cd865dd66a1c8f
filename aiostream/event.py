"""Events: markers in a stream's work that can be queried, awaited and timed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _backends, _check, _diagnostics, _objects
from ._backends.base import Interop
from .device import Device
from .device import device as _resolve_device
from .stream import Stream, stream_or_current

if TYPE_CHECKING:
    from ._backends.base import AnyBackend, WaitTarget

__all__ = ["Event"]


class Event(_objects.Awaitable):
    """A marker in a stream's work, as ``torch.Event`` / ``torch.cuda.Event``.

    ``record()`` captures the work submitted to a stream so far; ``await synchronize()``
    suspends the calling task until that work completes. An event never recorded is complete.
    The device-side event is created at the first record, as PyTorch does.

    Args:
        device: where the event lives; None for the default device.
        enable_timing: allow :meth:`elapsed_time` on this event.
        blocking: on CUDA, create it with ``CU_EVENT_BLOCKING_SYNC``.
        interprocess: allow :meth:`ipc_handle` (requires ``enable_timing=False``, as CUDA does).

    Example:
        >>> import anyio, aiostream as ais
        >>> async def main():
        ...     s = ais.Stream("virtual:0")
        ...     ais.delay(0.001, stream=s)
        ...     await s.record_event().synchronize()
        >>> anyio.run(main)

    Note:
        Wraps ``cuEventCreate``, ``cuEventRecord`` and ``cuEventQuery`` on CUDA.
    """

    __slots__ = ("_blocking", "_interprocess", "_label", "_recorded_on", "_timing")

    _what = "event"

    def __init__(
        self,
        device: Device | str | None = None,
        *,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
    ) -> None:
        self._timing = _check.flag(enable_timing, "enable_timing")
        self._blocking = _check.flag(blocking, "blocking")
        self._interprocess = _check.flag(interprocess, "interprocess")
        if enable_timing and interprocess:
            raise ValueError(
                "an interprocess event cannot have timing: pass enable_timing=False with "
                "interprocess=True (CUDA refuses the combination)"
            )
        dev = _resolve_device(device)
        # the device-side event is created at the first record (_create), as PyTorch does
        self._bind(dev, _backends.get(dev.type), None, None)
        self._recorded_on: int | None = None  # the stream of its last record, for listings
        self._label: str | None = None  # what listings call it (a graph's replay), if not that

    def _create(self) -> Any:
        handle = self._backend.event_create(
            self._device.index,
            timing=self._timing,
            blocking=self._blocking,
            interprocess=self._interprocess,
        )
        self._adopt(handle, self._backend.event_destroy)
        return handle

    # ------------------------------------------------------------------ properties

    @property
    def event_id(self) -> int:
        """0 until the first record; then non-zero, distinct between events, and stable (on
        CUDA, the ``CUevent`` handle, which others may then record)."""
        if self._handle is None:
            return 0
        backend = self._backend
        if isinstance(backend, Interop):
            return backend.event_native(self._handle)
        return backend.event_id(self._handle)

    def _id(self) -> int:
        """``event_id`` for aiostream's own messages (hands nothing out)."""
        return 0 if self._handle is None else self._backend.event_id(self._handle)

    @property
    def enable_timing(self) -> bool:
        """Whether :meth:`elapsed_time` works on this event."""
        return self._timing

    # ------------------------------------------------------------------ recording

    def record(self, stream: Stream | None = None) -> None:
        """Capture the work submitted to ``stream`` so far (the current stream when None).

        Re-recording moves the event to the new point; waits already started keep waiting for
        the work they captured.

        Note:
            Wraps ``cuEventRecord`` on CUDA.
        """
        stream = stream_or_current(stream, self._device)
        if stream.device != self._device:
            raise ValueError(
                f"cannot record an event of {self._device} on a stream of {stream.device}; "
                "create the event on the stream's device"
            )
        _objects.check_same_backend(self, stream)
        handle = self._handle if self._handle is not None else self._create()
        self._backend.event_record(handle, _objects.handle(stream))
        self._recorded_on = stream.stream_id
        if _diagnostics.debug:
            self._origin = _objects.note_submission(stream)

    def wait(self, stream: Stream | None = None) -> None:
        """Make later work on ``stream`` (the current stream when None) wait for this event."""
        stream_or_current(stream, self._device).wait_event(self)

    # ------------------------------------------------------------------ completion

    def query(self) -> bool:
        """Return whether the captured work has completed. Never blocks.

        Note:
            Wraps ``cuEventQuery`` on CUDA.
        """
        return True if self._handle is None else self._backend.event_query(self._handle)

    def _ready(self) -> bool:
        return True if self._handle is None else self._backend.event_query(self._handle, True)

    def _target(self, wake: bool) -> WaitTarget:
        target: WaitTarget = self._backend.event_target(self._handle, wake)
        return target

    def _subject(self) -> str:
        on = self._recorded_on
        what = (
            f"event {self._id()}" if self._label is None else f"{self._label} (event {self._id()})"
        )
        return what + ("" if on is None else f" on stream {on}")

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event and ``end_event``, both complete and timed.

        Raises:
            TypeError: ``end_event`` is not an Event.
            ValueError: an event lacks timing, was never recorded, or is on another device.
            NotReadyError: an event's work has not completed yet.

        Note:
            Wraps ``cuEventElapsedTime`` on CUDA.
        """
        if not isinstance(end_event, Event):
            raise TypeError(f"end_event must be an aiostream.Event, got {end_event!r}")
        for name, ev in (("start event", self), ("end event", end_event)):
            if not ev.enable_timing:
                raise ValueError(
                    f"elapsed_time() needs timing on both events, but the {name} was created "
                    "without it; create it with Event(enable_timing=True)"
                )
            if _objects.handle(ev) is None:
                raise ValueError(
                    f"elapsed_time() needs two recorded events, but the {name} was never "
                    "recorded; call record() on it first"
                )
        if end_event.device != self._device:
            raise ValueError(
                f"elapsed_time() needs events of one device, got {self._device} and "
                f"{end_event.device}"
            )
        _objects.check_same_backend(self, end_event)
        return self._backend.event_elapsed_ms(self._handle, _objects.handle(end_event))

    # ------------------------------------------------------------------ sharing

    def ipc_handle(self) -> bytes:
        """Return a 64-byte handle that :meth:`from_ipc_handle` opens in another process.

        The virtual backend supports the round trip within one process only.

        Note:
            Wraps ``cuIpcGetEventHandle`` on CUDA.
        """
        if not self._interprocess:
            raise ValueError(
                "ipc_handle() needs an interprocess event; create it with Event(interprocess=True)"
            )
        handle = self._handle if self._handle is not None else self._create()
        return self._backend.event_ipc_handle(handle)

    @classmethod
    def from_ipc_handle(cls, device: Device | str | None, handle: bytes) -> Event:
        """Open an event shared by :meth:`ipc_handle`.

        Raises:
            TypeError: ``handle`` is not bytes-like.
            ValueError: ``handle`` is not 64 bytes, or not a handle this backend made.

        Note:
            Wraps ``cuIpcOpenEventHandle`` on CUDA.
        """
        if not isinstance(handle, (bytes, bytearray, memoryview)):
            raise TypeError(f"handle must be bytes (from Event.ipc_handle()), got {handle!r}")
        data = bytes(handle)
        if len(data) != 64:
            raise ValueError(f"an event IPC handle is 64 bytes, got {len(data)}")
        event = cls(device, interprocess=True)
        event._open_ipc(data)
        return event

    def _open_ipc(self, data: bytes) -> None:
        backend = self._backend
        self._adopt(backend.event_from_ipc_handle(self._device.index, data), backend.event_destroy)

    def __repr__(self) -> str:
        return (
            f"<aiostream.Event device={self._device} id={self._id()} "
            f"timing={self._timing} interprocess={self._interprocess}>"
        )


def foreign_event(device: Device, backend: AnyBackend, handle: Any) -> Event:
    """An Event over a handle made elsewhere (``as_event``), not owned: never destroyed here.

    Its flags are unknown, so timing is left to the driver to refuse.
    """
    event = _objects.unowned(Event, device, backend, handle)
    flags = True, False, False  # timing, blocking, interprocess
    event._timing, event._blocking, event._interprocess = flags  # noqa: SLF001 (this module's)
    event._recorded_on = None  # noqa: SLF001
    event._label = None  # noqa: SLF001
    return event
