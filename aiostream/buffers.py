"""Host and device buffers, and asynchronous copies between them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _backends, _check, _objects
from .device import Device
from .device import device as _resolve_device
from .stream import Stream, current_stream, stream_or_current

__all__ = ["DeviceBuffer", "HostBuffer", "copy_async"]


_MAX_NBYTES = 1 << 63


def _nbytes(value: object) -> int:
    value = _check.integer(value, "nbytes", minimum=0)
    if value >= _MAX_NBYTES:
        raise ValueError(f"nbytes must be below 2**63, which no host or device holds; got {value}")
    return value


def _shape_for(nbytes: int, dtype: Any, shape: Any) -> tuple[np.dtype, tuple[int, ...]]:
    dt = np.dtype(dtype)
    if dt.itemsize == 0:
        raise ValueError(f"dtype {dtype!r} has no size; give a dtype of at least one byte")
    if shape is None:
        if nbytes % dt.itemsize:
            raise ValueError(f"{nbytes} bytes do not hold a whole number of {dt} items")
        return dt, (nbytes // dt.itemsize,)
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise ValueError(f"shape must be non-negative ints, got {shape!r}")
    need = math.prod(int(d) for d in dims) * dt.itemsize  # exact: no int64 overflow
    if need != nbytes:
        raise ValueError(
            f"shape {tuple(dims)} of {dt} needs {need} bytes, but the buffer has {nbytes}"
        )
    return dt, tuple(int(d) for d in dims)


class _Owner:
    """What a :meth:`HostBuffer.numpy` array is made from: it holds the buffer, so the array
    (whose ``.base`` chain ends here) keeps the memory alive, on every backend; freed pinned
    memory is unmapped, and touching it would crash the process."""

    __slots__ = ("__array_interface__", "buffer", "raw")

    def __init__(self, raw: np.ndarray, buffer: HostBuffer) -> None:
        self.raw = raw
        self.buffer = buffer
        self.__array_interface__ = raw.__array_interface__


class HostBuffer(_objects.DeviceObject):
    """Host memory for copies to and from a device.

    Page-locked (pinned) through the driver on CUDA, so copies are truly asynchronous; plain
    memory on virtual devices. :meth:`numpy` gives a zero-copy view.

    Args:
        nbytes: the size in bytes.
        pinned: page-lock the memory (CUDA); ignored on virtual devices.
        device: whose backend allocates it; None for the default device.

    Example:
        >>> buf = HostBuffer(16, device="virtual:0")
        >>> buf.numpy(np.float32).shape
        (4,)

    Raises:
        DeviceError: the machine cannot give that much host memory (as ``DeviceBuffer``
            raises it for device memory); the device goes on.

    Note:
        Wraps ``cuMemHostAlloc`` on CUDA.
    """

    __slots__ = ("_nbytes", "_pinned")

    def __init__(
        self, nbytes: int, *, pinned: bool = True, device: Device | str | None = None
    ) -> None:
        self._nbytes = _nbytes(nbytes)
        if not isinstance(pinned, bool):
            raise TypeError(f"pinned must be True or False, got {pinned!r}")
        self._pinned = pinned
        dev = _resolve_device(device)
        backend = _backends.get(dev.type)
        handle = backend.host_alloc(dev.index, self._nbytes, pinned=pinned)
        self._bind(dev, backend, handle, backend.host_free)

    @property
    def nbytes(self) -> int:
        """The size in bytes."""
        return self._nbytes

    @property
    def pinned(self) -> bool:
        """Whether the memory was asked to be page-locked."""
        return self._pinned

    def numpy(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        """A zero-copy numpy view of the memory, of ``dtype`` and ``shape`` (1-D by default).

        The view keeps this buffer alive (through its ``.base``). Read it only after the
        copies into it have completed (await their event or stream): on virtual devices, asking
        for a view while a copy into the buffer is in flight is recorded as a race
        (``aiostream.virtual.races()``) and the bytes hold ``aiostream.virtual.POISON`` until
        the copy lands.
        """
        dt, dims = _shape_for(self._nbytes, dtype, shape)
        self._backend.host_access(self._handle)
        raw = np.frombuffer(self._backend.host_view(self._handle), dtype=dt)
        view: np.ndarray = np.asarray(_Owner(raw, self))
        return view.reshape(dims)

    def __repr__(self) -> str:
        return (
            f"<aiostream.HostBuffer {self._nbytes} bytes pinned={self._pinned} on {self._device}>"
        )


class DeviceBuffer(_objects.DeviceObject):
    """Device memory of ``nbytes``, allocated stream-ordered on the current stream where the
    backend can.

    It carries a ``dtype`` and ``shape`` for interop (``uint8`` and ``(nbytes,)`` unless made by
    :meth:`view`). On CUDA it exposes ``__cuda_array_interface__`` (version 3, with the stream of
    its allocation), so CuPy, Numba and PyTorch can use it without copies.

    When it is collected, the memory is freed on the device (never with a host wait) once the
    work of every stream that used it has completed: its allocation stream, the streams of
    aiostream's copies, and those named with :meth:`record_stream`.

    Note:
        Wraps ``cuMemAllocAsync`` / ``cuMemFreeAsync`` on CUDA (``cuMemAlloc`` / ``cuMemFree``
        on a device without memory pools).
    """

    __slots__ = ("_base", "_dtype", "_nbytes", "_shape", "_stream")

    def __init__(self, nbytes: int, device: Device | str | None = None) -> None:
        self._nbytes = _nbytes(nbytes)
        dev = _resolve_device(device)
        backend = _backends.get(dev.type)
        stream = current_stream(dev)
        self._stream: Stream | None = stream
        handle = backend.device_alloc(dev.index, self._nbytes, _objects.handle(stream))
        self._bind(dev, backend, handle, backend.device_free)
        self._dtype: np.dtype = np.dtype(np.uint8)
        self._shape: tuple[int, ...] = (self._nbytes,)
        self._base: DeviceBuffer | None = None

    @property
    def nbytes(self) -> int:
        """The size in bytes."""
        return self._nbytes

    @property
    def dtype(self) -> np.dtype:
        """The element type used for interop."""
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape used for interop."""
        return self._shape

    def view(self, dtype: Any, shape: Any = None) -> DeviceBuffer:
        """The same memory seen as ``dtype`` and ``shape``; it keeps this buffer alive."""
        dt, dims = _shape_for(self._nbytes, dtype, shape)
        other: DeviceBuffer = _objects.unowned(
            DeviceBuffer, self._device, self._backend, self._handle
        )
        other._nbytes, other._stream = self._nbytes, self._stream
        other._dtype, other._shape = dt, dims
        other._base = self._base if self._base is not None else self
        return other

    def record_stream(self, stream: Stream) -> None:
        """Mark ``stream`` as using this memory (as ``torch.Tensor.record_stream``).

        The memory is freed only after the work submitted to ``stream`` by then has
        completed, besides the work of its allocation stream and of the streams aiostream's
        copies used it on. On CUDA a stream's first use of a stream-ordered allocation is
        also ordered after the allocation, on the device. Call it for every other stream your
        kernels use the buffer on.

        Raises:
            TypeError: ``stream`` is not a Stream.
            ValueError: the stream is on another device.
        """
        if not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream, got {stream!r}")
        if stream.device != self._device:
            raise ValueError(
                f"the buffer is on {self._device}, the stream on {stream.device}: a stream "
                "uses memory of its own device"
            )
        _objects.check_same_backend(stream, self)
        self._backend.memory_use(self._handle, _objects.handle(stream))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 of the CUDA array interface (CUDA devices only)."""
        ptr = self._backend.device_ptr(self._handle)
        stream = self._stream.stream_id if self._stream is not None else 0
        return {
            "shape": self._shape,
            "typestr": self._dtype.str,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": stream or 1,  # 1: the legacy default stream (0 is not allowed)
        }

    def __repr__(self) -> str:
        return (
            f"<aiostream.DeviceBuffer {self._nbytes} bytes on {self._device} "
            f"dtype={self._dtype} shape={self._shape}>"
        )


Buffer = HostBuffer | DeviceBuffer


def copy_async(dst: Buffer, src: Buffer, *, stream: Stream | None = None) -> None:
    """Enqueue a copy of ``src`` into ``dst`` on ``stream``: host-to-device, device-to-host or
    device-to-device. The host does not wait; the data has landed when work recorded after the
    copy has completed.

    Both buffers stay alive until the copy completes, even if the caller drops them.

    Args:
        dst: the destination, a :class:`HostBuffer` or :class:`DeviceBuffer`.
        src: the source, of the same size.
        stream: the stream to copy on; None for the current stream of the device buffer's
            device (of ``dst`` when both are device buffers).

    Raises:
        TypeError: a buffer is not a HostBuffer or DeviceBuffer, or ``stream`` not a Stream.
        ValueError: the sizes differ, both are host buffers, or devices do not match.

    Note:
        Wraps ``cuMemcpyHtoDAsync``, ``cuMemcpyDtoHAsync`` and ``cuMemcpyDtoDAsync`` on CUDA.
    """
    for name, buf in (("dst", dst), ("src", src)):
        if not isinstance(buf, (HostBuffer, DeviceBuffer)):
            raise TypeError(f"{name} must be a HostBuffer or DeviceBuffer, got {buf!r}")
    if dst.nbytes != src.nbytes:
        raise ValueError(
            f"copy_async needs equal sizes, got dst {dst.nbytes} and src {src.nbytes} bytes"
        )
    if isinstance(dst, HostBuffer) and isinstance(src, HostBuffer):
        raise ValueError("copy_async copies to or from a device; for host to host use numpy")
    kind = "h2d" if isinstance(src, HostBuffer) else "d2h" if isinstance(dst, HostBuffer) else "d2d"
    dev_buf = dst if isinstance(dst, DeviceBuffer) else src
    if kind == "d2d" and src.device != dst.device:
        raise ValueError(f"copy_async copies within one device, got {src.device} and {dst.device}")
    stream = stream_or_current(stream, dev_buf.device)
    if stream.device != dev_buf.device:
        raise ValueError(
            f"the device buffer is on {dev_buf.device}, but the stream is on {stream.device}"
        )
    _objects.check_same_backend(stream, dst)
    _objects.check_same_backend(stream, src)
    copy = _objects.backend(stream).copy
    dst_h, src_h = _objects.handle(dst), _objects.handle(src)
    _objects.submit(stream, f"copy {kind}", copy, dst_h, src_h, dst.nbytes, kind)
