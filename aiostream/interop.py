"""Interop with other GPU libraries: their streams and events as aiostream objects.

PyTorch and CuPy stay optional: these functions read the attributes those libraries define
(``cuda_stream``, ``ptr``, ``cuda_event``) and never import them.
"""

from __future__ import annotations

from typing import Any

from . import _backends, _check
from ._backends.base import Interop
from .device import Device
from .device import device as _resolve_device
from .event import Event, foreign_event
from .stream import ExternalStream, Stream

__all__ = ["as_event", "as_stream"]

_STREAMS = (
    "an aiostream.Stream, an object with __cuda_stream__, a torch.cuda.Stream, a CuPy stream "
    "or an int CUstream handle"
)


def _owner_device(obj: Any, device: Device | str | None) -> Device | str:
    """The device given, else the one the foreign object says it is on, else ``cuda:0``."""
    if device is not None:
        return device
    index = getattr(getattr(obj, "device", None), "index", None)  # torch
    if index is None:
        index = getattr(obj, "device_id", None)  # CuPy
    if isinstance(index, int) and not isinstance(index, bool):
        return Device("cuda", index)
    return "cuda:0"


def as_stream(obj: Any, device: Device | str | None = None) -> Stream:
    """Return ``obj`` as an aiostream Stream that can be awaited and recorded on.

    Accepts, in this order: an aiostream ``Stream`` (returned as it is), any object with
    ``__cuda_stream__()`` (returning ``(0, handle)``), a ``torch.cuda.Stream``
    (``cuda_stream``), a CuPy stream (``ptr``), or an int handle. Foreign streams are wrapped
    as :class:`ExternalStream`, without taking ownership.

    Args:
        obj: the stream.
        device: the CUDA device it belongs to; None to take it from ``obj`` (torch's
            ``device.index``, CuPy's ``device_id``), else ``cuda:0``.

    Raises:
        TypeError: ``obj`` is none of the above.
        ValueError: ``__cuda_stream__`` returned something other than ``(0, handle)``.
    """
    if isinstance(obj, Stream):
        return obj
    protocol = getattr(obj, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol()
        if not (isinstance(value, tuple) and len(value) == 2 and value[0] == 0):
            raise ValueError(
                f"{type(obj).__name__}.__cuda_stream__() must return (0, handle), got {value!r}"
            )
        return ExternalStream(int(value[1]), _owner_device(obj, device))
    for attr in ("cuda_stream", "ptr"):
        handle = getattr(obj, attr, None)
        if isinstance(handle, int) and not isinstance(handle, bool):
            return ExternalStream(handle, _owner_device(obj, device))
    if isinstance(obj, int) and not isinstance(obj, bool):
        return ExternalStream(obj, _owner_device(obj, device))
    raise TypeError(f"as_stream() needs {_STREAMS}; got {obj!r} of type {type(obj).__name__}")


def as_event(obj: Any, device: Device | str | None = None) -> Event:
    """Return ``obj`` as an aiostream Event, so that it can be awaited.

    Accepts an aiostream ``Event`` (returned as it is), a ``torch.cuda.Event``
    (``cuda_event``) or an int ``CUevent`` handle. The event is wrapped without taking
    ownership; ``record()`` on the wrapper records the same CUDA event.

    Example:
        >>> done = torch.cuda.Event(); done.record()  # doctest: +SKIP
        >>> await ais.as_event(done).synchronize()  # doctest: +SKIP

    Raises:
        TypeError: ``obj`` is none of the above.
        ValueError: the event has no CUDA event yet (torch makes it at the first record), or
            the int is no pointer.

    A handle must be a live one, made by the library that owns it: the driver cannot tell a
    stale or made-up handle, and may crash the process on one.
    """
    if isinstance(obj, Event):
        return obj
    handle = getattr(obj, "cuda_event", obj)
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(
            "as_event() needs an aiostream.Event, a torch.cuda.Event or an int CUevent handle; "
            f"got {obj!r} of type {type(obj).__name__}"
        )
    if handle <= 0:
        raise ValueError(
            f"{obj!r} has no CUDA event yet: record it first (PyTorch creates the CUDA event at "
            "the first record())"
        )
    _check.handle(handle, "the CUevent handle", what="an int")
    dev = _resolve_device(_owner_device(obj, device))
    backend = _backends.get(dev.type)
    if not isinstance(backend, Interop):
        raise ValueError(f"as_event() wraps CUDA events; device must be cuda:N, got {dev}")
    return foreign_event(dev, backend, backend.event_wrap(dev.index, handle))
