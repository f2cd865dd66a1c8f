"""Interop with other GPU libraries: their streams and events as aiostream objects.

PyTorch, CuPy and cuda.core stay optional: these functions read the attributes those libraries
define and never import them:

============================  ===============================  ================================
object                        handle read from                 device read from
============================  ===============================  ================================
``torch.cuda.Stream``         ``cuda_stream``                  ``device.index``
``torch.Stream`` (CUDA)       ``stream_id``, through PyTorch   ``device_index``
``cupy.cuda.Stream``          ``ptr``                          ``device_id``
``cuda.core`` ``Stream``      ``__cuda_stream__()``            ``device.device_id``
``torch.cuda.Event``          ``cuda_event``                   ``device.index``
``torch.Event`` (CUDA)        ``event_id``                     ``device.index``
``cupy.cuda.Event``           ``ptr``                          (``device=``, else ``cuda:0``)
``cuda.core`` ``Event``       ``int(handle)``                  ``device.device_id``
============================  ===============================  ================================
"""

from __future__ import annotations

import sys
from typing import Any

from . import _backends, _check
from ._backends.base import Interop
from .device import Device
from .device import device as _resolve_device
from .event import Event, foreign_event
from .stream import ExternalStream, Stream

__all__ = ["as_event", "as_stream"]

_STREAMS = (
    "an aiostream.Stream, an object with __cuda_stream__ (a cuda.core Stream), a "
    "torch.cuda.Stream, a torch.Stream of a CUDA device, a CuPy stream or an int CUstream handle"
)
_EVENTS = (
    "an aiostream.Event, a torch.cuda.Event, a torch.Event of a CUDA device, a CuPy event, a "
    "cuda.core Event or an int CUevent handle"
)
_TORCH_CUDA = 1  # c10::DeviceType::CUDA, torch.Stream's device_type
_TORCH_CUDA_NAME = "cuda"  # torch.device("cuda").type, a torch.Event's device type


def _int(value: object) -> int | None:
    """``value`` as an int if it is one (never a bool)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _owner_device(obj: Any, device: Device | str | None) -> Device | str:
    """The device given, else the one the foreign object says it is on, else ``cuda:0``."""
    if device is not None:
        return device
    owner = getattr(obj, "device", None)
    for index in (
        getattr(owner, "index", None),  # torch: a torch.device
        getattr(obj, "device_index", None),  # torch.Stream
        getattr(obj, "device_id", None),  # CuPy
        getattr(owner, "device_id", None),  # cuda.core: a Device
    ):
        if _int(index) is not None:
            return Device("cuda", index)  # type: ignore[arg-type]
    return "cuda:0"


def _torch_stream_handle(obj: Any) -> int:
    """The CUstream of a ``torch.Stream``: its ``stream_id`` is PyTorch's own id (pool streams
    are numbered by PyTorch), so PyTorch, already imported since the object exists, turns it
    into the stream (``torch.cuda.Stream(stream_id=, device_index=, device_type=)``)."""
    device_type = _int(getattr(obj, "device_type", None))
    if device_type != _TORCH_CUDA:
        raise ValueError(
            f"{obj!r} is a stream of PyTorch device type {device_type}, not a CUDA stream "
            "(device type 1): pass a stream of a CUDA device"
        )
    torch = sys.modules.get("torch")
    cuda_stream = getattr(getattr(torch, "cuda", None), "Stream", None)
    if cuda_stream is None:
        raise TypeError(
            f"{obj!r} looks like a torch.Stream, but PyTorch is not imported, and its stream_id "
            "is PyTorch's own number, not a CUstream: pass torch.cuda.Stream objects, or the "
            "handle (an int)"
        )
    native = cuda_stream(
        stream_id=obj.stream_id, device_index=obj.device_index, device_type=device_type
    )
    handle = _int(getattr(native, "cuda_stream", None))
    if handle is None:
        raise TypeError(f"PyTorch gave no CUstream (cuda_stream) for {obj!r}")
    return handle


def as_stream(obj: Any, device: Device | str | None = None) -> Stream:
    """Return ``obj`` as an aiostream Stream that can be awaited and recorded on.

    Accepts, in this order: an aiostream ``Stream`` (returned as it is), any object with
    ``__cuda_stream__()`` returning ``(0, handle)`` (a cuda.core ``Stream``, an aiostream
    Stream of another wrapper), a ``torch.cuda.Stream`` (``cuda_stream``), a CuPy stream
    (``ptr``), a ``torch.Stream`` of a CUDA device (``stream_id``, ``device_index`` and
    ``device_type``, turned into the stream by PyTorch), or an int handle. Foreign streams are
    wrapped as :class:`ExternalStream`, without taking ownership.

    Args:
        obj: the stream.
        device: the CUDA device it belongs to; None to take it from ``obj`` (torch's
            ``device.index`` or ``device_index``, CuPy's ``device_id``, cuda.core's
            ``device.device_id``), else ``cuda:0``.

    Raises:
        TypeError: ``obj`` is none of the above.
        ValueError: ``__cuda_stream__`` returned something other than ``(0, handle)``, or a
            ``torch.Stream`` is not of a CUDA device.
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
        handle = _int(getattr(obj, attr, None))
        if handle is not None:
            return ExternalStream(handle, _owner_device(obj, device))
    if _int(getattr(obj, "stream_id", None)) is not None and hasattr(obj, "device_type"):
        return ExternalStream(_torch_stream_handle(obj), _owner_device(obj, device))
    if _int(obj) is not None:
        return ExternalStream(obj, _owner_device(obj, device))
    raise TypeError(f"as_stream() needs {_STREAMS}; got {obj!r} of type {type(obj).__name__}")


def _event_handle(obj: Any) -> int | None:
    """The CUevent of a foreign event, or None if ``obj`` is no event aiostream knows."""
    handle = _int(getattr(obj, "cuda_event", None))  # torch.cuda.Event
    if handle is not None:
        return handle
    handle = _int(getattr(obj, "event_id", None))  # torch.Event
    if handle is not None:
        kind = getattr(getattr(obj, "device", None), "type", _TORCH_CUDA_NAME)
        if kind != _TORCH_CUDA_NAME:
            raise ValueError(
                f"{obj!r} is an event of PyTorch's {kind!r} device, not a CUDA event: pass "
                "an event of a CUDA device"
            )
        return handle
    handle = _int(getattr(obj, "ptr", None))  # CuPy
    if handle is not None:
        return handle
    native = getattr(obj, "handle", None)  # cuda.core: a CUevent, which int() reads
    if native is not None and not isinstance(native, (bool, str, bytes, float)):
        try:
            return int(native)
        except (TypeError, ValueError):
            return None
    return _int(obj)


def as_event(obj: Any, device: Device | str | None = None) -> Event:
    """Return ``obj`` as an aiostream Event, so that it can be awaited.

    Accepts an aiostream ``Event`` (returned as it is), a ``torch.cuda.Event``
    (``cuda_event``), a ``torch.Event`` of a CUDA device (``event_id``), a CuPy event
    (``ptr``), a cuda.core ``Event`` (``int(handle)``) or an int ``CUevent`` handle. The
    event is wrapped without taking ownership; ``record()`` on the wrapper records the same
    CUDA event.

    Args:
        obj: the event.
        device: the CUDA device it belongs to; None to take it from ``obj`` (torch's
            ``device.index``, cuda.core's ``device.device_id``), else ``cuda:0`` (a CuPy event
            says nothing of its device: pass it).

    Example:
        >>> done = torch.cuda.Event(); done.record()  # doctest: +SKIP
        >>> await ais.as_event(done).synchronize()  # doctest: +SKIP

    Raises:
        TypeError: ``obj`` is none of the above.
        ValueError: the event has no CUDA event yet (PyTorch makes it at the first record),
            is of a device that is not CUDA's, or the int is no pointer.

    A handle must be a live one, made by the library that owns it: the driver cannot tell a
    stale or made-up handle, and may crash the process on one.
    """
    if isinstance(obj, Event):
        return obj
    handle = _event_handle(obj)
    if handle is None:
        raise TypeError(f"as_event() needs {_EVENTS}; got {obj!r} of type {type(obj).__name__}")
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
