"""Host and device buffers, and asynchronous copies between them."""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Any

from .. import _backends, _captures, _check, _hooks, _objects
from .._backends.base import Interop
from .._errors import pageable_copy
from ..device import Device
from ..device import device as _resolve_device
from ..event import Event
from ..stream import Stream, current_stream, stream_or_current
from . import _dlpack
from ._dlpack import DLDeviceType

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DeviceBuffer", "HostBuffer", "copy_async", "from_dlpack"]


_MAX_NBYTES = 1 << 63


def _nbytes(value: object) -> int:
    value = _check.integer(value, "nbytes", minimum=0)
    if value >= _MAX_NBYTES:
        raise ValueError(f"nbytes must be below 2**63, which no host or device holds; got {value}")
    return value


def _shape_for(nbytes: int, dtype: Any, shape: Any) -> tuple[np.dtype, tuple[int, ...]]:
    import numpy as np  # when buffers are used: ``import aiostream`` stays light

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


def _bytes() -> np.dtype:
    """A device buffer's type until it is viewed as another: bytes."""
    import numpy as np

    return np.dtype(np.uint8)


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
        _captures.check_allocation(None)
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

    def numpy(self, dtype: Any = "uint8", shape: Any = None) -> np.ndarray:
        """A zero-copy numpy view of the memory, of ``dtype`` and ``shape`` (1-D by default).

        The view keeps this buffer alive (through its ``.base``). Read it only after the
        copies into it have completed (await their event or stream): on virtual devices, asking
        for a view while a copy into the buffer is in flight is recorded as a race
        (``aiostream.virtual.races()``) and the bytes hold ``aiostream.virtual.POISON`` until
        the copy lands.
        """
        dt, dims = _shape_for(self._nbytes, dtype, shape)
        self._backend.host_access(self._handle)
        import numpy as np

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
    :meth:`view`). It speaks DLPack (``__dlpack__``, ``__dlpack_device__``), which PyTorch, CuPy,
    JAX and NumPy read with their ``from_dlpack``; on CUDA it also exposes
    ``__cuda_array_interface__`` (version 3, with the stream of its allocation), which CuPy,
    Numba and PyTorch read. Either way no copy is made.

    When it is collected, the memory is freed on the device (never with a host wait) once the
    work of every stream that used it has completed: its allocation stream, the streams of
    aiostream's copies, and those named with :meth:`record_stream`.

    Args:
        nbytes: the size in bytes.
        device: where; None for the default device.
        interprocess: allocate memory that :meth:`ipc_handle` can share with another process
            (on CUDA ``cuMemAlloc``'s, outside the stream-ordered pool, which the driver does
            not share that way).

    Note:
        Wraps ``cuMemAllocAsync`` / ``cuMemFreeAsync`` on CUDA (``cuMemAlloc`` / ``cuMemFree``
        on a device without memory pools, and for ``interprocess=True``).
    """

    __slots__ = (
        "_base",
        "_dtype",
        "_interprocess",
        "_ipc_event",
        "_nbytes",
        "_producer",
        "_read_only",
        "_shape",
        "_stream",
    )

    def __init__(
        self, nbytes: int, device: Device | str | None = None, *, interprocess: bool = False
    ) -> None:
        self._nbytes = _nbytes(nbytes)
        self._interprocess = _check.flag(interprocess, "interprocess")
        dev = _resolve_device(device)
        backend = _backends.get(dev.type)
        stream = current_stream(dev)
        _captures.check_allocation(_capturing(stream))
        self._stream: Stream | None = stream
        alloc = backend.device_alloc_interprocess if interprocess else backend.device_alloc
        handle = alloc(dev.index, self._nbytes, _objects.handle(stream))
        self._bind(dev, backend, handle, backend.device_free)
        self._dtype: np.dtype = _bytes()
        self._shape: tuple[int, ...] = (self._nbytes,)
        self._base: DeviceBuffer | None = None
        self._ipc_event: Event | None = None
        self._producer: object = None
        self._read_only = False  # a DLPack producer's read-only memory (from_dlpack)

    @classmethod
    def _over(
        cls,
        device: Device,
        backend: Any,
        handle: Any,
        stream: Stream,
        dtype: np.dtype,
        shape: tuple[int, ...],
        producer: object = None,
    ) -> DeviceBuffer:
        """A buffer over memory opened or wrapped here (not allocated): freeing it closes or
        releases it (the backend's rule), after its users' work."""
        buf: DeviceBuffer = _objects.unowned(cls, device, backend, None)
        buf._adopt(handle, backend.device_free)
        buf._nbytes, buf._stream, buf._interprocess = (
            math.prod(shape) * dtype.itemsize,
            stream,
            False,
        )
        buf._dtype, buf._shape = dtype, shape
        buf._base, buf._ipc_event, buf._producer, buf._read_only = None, None, producer, False
        return buf

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
        other._interprocess, other._ipc_event, other._producer = self._interprocess, None, None
        other._read_only = self._read_only
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
            "data": (ptr, self._read_only),
            "version": 3,
            "strides": None,
            "stream": stream or 1,  # 1: the legacy default stream (0 is not allowed)
        }

    # ------------------------------------------------------------------ DLPack

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        """``(device type, device id)`` in DLPack's terms: ``(kDLCUDA, index)`` on CUDA.

        A virtual device's memory is host memory, exported as such: ``(kDLCPU, 0)``, so NumPy
        (``np.from_dlpack``) and CPU PyTorch read it in tests.
        """
        kind, index = self._backend.dlpack_device(self._device.index)
        return DLDeviceType(kind), index

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """Export the buffer as a DLPack capsule (the array API standard's protocol), without a
        copy; ``from_dlpack`` of PyTorch, CuPy, JAX or NumPy calls it.

        The buffer stays alive while the consumer's array does (the capsule's deleter holds
        it). A versioned capsule (``dltensor_versioned``, DLPack 1.0) when ``max_version``
        allows, the legacy one (``dltensor``) otherwise.

        On CUDA, ``stream`` is the consumer's stream: it is made to wait, on the device, for
        the work submitted so far to every stream that used the buffer (an event recorded
        after it, and ``cuStreamWaitEvent``); the host never waits. ``None`` and ``1`` mean the
        legacy default stream, ``2`` the per-thread default stream, ``-1`` no synchronization.

        On a virtual device the memory is exported as host memory (``kDLCPU``), and ``stream``
        must be None. Reading it while a copy into the buffer is in flight is a race: the
        export is recorded as one (``aiostream.virtual.races()``, as for
        ``HostBuffer.numpy()``), and the bytes hold ``aiostream.virtual.POISON`` until the copy
        lands. Await the copy first.

        Raises:
            BufferError: ``dl_device`` names another device, ``copy=True`` (the export never
                copies: copy with ``copy_async`` and export the copy), or a dtype DLPack lacks.
            ValueError: a stream value the standard disallows (0 on CUDA; any but None for
                host memory), or ``dl_device`` asks for host memory with ``copy=False``.
            TypeError: an argument of the wrong type.

        Note:
            Wraps ``cuEventRecord`` and ``cuStreamWaitEvent`` on CUDA.
        """
        backend = self._backend
        index = self._device.index
        device = backend.dlpack_device(index)
        consumer, versioned = _dlpack.check_export(device, stream, max_version, dl_device, copy)
        if consumer is not None and isinstance(backend, Interop):
            if consumer == 1:  # the legacy default stream
                waiter = backend.stream_default(index)
            else:
                waiter, _ = backend.stream_wrap(index, consumer)
            backend.memory_wait(self._handle, waiter)
        address = backend.memory_export(self._handle)
        ro = self._read_only  # what a producer exported read-only stays so
        return _dlpack.export(
            self, address, device, self._dtype, self._shape, versioned=versioned, read_only=ro
        )

    # ------------------------------------------------------------------ other processes

    def ipc_handle(self) -> bytes:
        """A handle that :meth:`from_ipc_handle` opens in another process, as PyTorch shares
        CUDA tensors: the memory's handle (``cuIpcGetMemHandle``) and an interprocess event's.

        The event is recorded now on the current stream of the buffer's device, which is first
        made to wait (on the device) for the work of every stream that used the buffer; the
        other process's stream waits for it before it uses the memory. Keep this buffer alive
        until the other process is done with the memory (freeing it while that process uses it
        is undefined on CUDA).

        A virtual device shares its buffers within one process only, as its events.

        Raises:
            ValueError: the buffer was not created with ``interprocess=True``.

        Note:
            Wraps ``cuIpcGetMemHandle``, ``cuEventRecord`` and ``cuIpcGetEventHandle`` on CUDA.
        """
        if not self._interprocess:
            raise ValueError(
                "ipc_handle() needs memory that another process can open: create the buffer "
                "with DeviceBuffer(nbytes, device, interprocess=True) (the stream-ordered "
                "pool's memory cannot be shared that way)"
            )
        stream = current_stream(self._device)
        _objects.check_same_backend(stream, self)
        self._backend.memory_wait(self._handle, _objects.handle(stream))
        event = self._ipc_event
        if event is None:
            event = self._ipc_event = Event(self._device, interprocess=True)
        event.record(stream)
        memory = self._backend.memory_ipc_handle(self._handle)
        shared = event.ipc_handle()
        header = struct.pack(_IPC_HEADER, _IPC_MAGIC, self._nbytes, len(memory), len(shared))
        return header + memory + shared

    @classmethod
    def from_ipc_handle(cls, device: Device | str | None, handle: bytes) -> DeviceBuffer:
        """Open a buffer another process shared with :meth:`ipc_handle`: its memory, as
        ``uint8`` of its size (:meth:`view` gives it a dtype and shape).

        The current stream of ``device`` waits, on the device, for the exporter's event, and
        is the buffer's allocation stream: use the buffer there, or make other streams wait
        for it (``Stream.wait_stream``). On CUDA another stream's first use waits for it
        anyway, as for a stream-ordered allocation. Freeing the buffer closes the memory
        (``cuIpcCloseMemHandle``) after the work of the streams that used it. In the process
        that made the handle (where the driver opens nothing) it gives a buffer over the same
        memory, ordered as elsewhere, freed once both buffers are dropped.

        Raises:
            TypeError: ``handle`` is not bytes.
            ValueError: ``handle`` is not a buffer's IPC handle (or, made in this process, its
                buffer no longer exists, or it is opened on another device than its own).
            StaleHandleError: on a virtual device, a handle of another process or of a
                replaced backend.

        Note:
            Wraps ``cuIpcOpenMemHandle``, ``cuIpcOpenEventHandle`` and ``cuStreamWaitEvent``.
        """
        if not isinstance(handle, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"handle must be bytes (from DeviceBuffer.ipc_handle()), got {handle!r}"
            )
        data = bytes(handle)
        size = struct.calcsize(_IPC_HEADER)
        magic, nbytes, mem_len, event_len = (
            struct.unpack_from(_IPC_HEADER, data) if len(data) >= size else (b"", 0, 0, 0)
        )
        if magic != _IPC_MAGIC or len(data) != size + mem_len + event_len:
            raise ValueError(
                "handle is not a DeviceBuffer IPC handle: pass the bytes that "
                "DeviceBuffer.ipc_handle() returned, unchanged"
            )
        nbytes = _nbytes(nbytes)
        memory, shared = data[size : size + mem_len], data[size + mem_len :]
        dev = _resolve_device(device)
        backend = _backends.get(dev.type)
        stream = current_stream(dev)
        mem = backend.memory_from_ipc_handle(
            dev.index, memory, shared, nbytes, _objects.handle(stream)
        )
        return cls._over(dev, backend, mem, stream, _bytes(), (nbytes,))

    def __repr__(self) -> str:
        return (
            f"<aiostream.DeviceBuffer {self._nbytes} bytes on {self._device} "
            f"dtype={self._dtype} shape={self._shape}>"
        )


_IPC_MAGIC = b"aiosbuf\x01"
_IPC_HEADER = "<8sQHH"  # magic, nbytes, the memory handle's length, the event handle's


def from_dlpack(obj: Any, *, stream: Stream | None = None) -> DeviceBuffer:
    """Wrap another library's CUDA array (anything with ``__dlpack__``: a PyTorch tensor, a
    CuPy or JAX array) as a :class:`DeviceBuffer`, without copying.

    The buffer has the array's dtype and shape, on the device its ``__dlpack_device__`` names.
    ``stream`` (the current stream of that device by default) is handed to the producer, which
    makes it wait for the array's pending work on the device; it is the buffer's allocation
    stream. The producer's memory is released (its capsule's deleter called) once the buffer
    is collected and the work of every stream that used it has completed; the buffer holds
    ``obj`` until then.

    Example:
        >>> t = torch.arange(4.0, device="cuda")  # doctest: +SKIP
        >>> buf = ais.from_dlpack(t)  # doctest: +SKIP
        >>> host = ais.HostBuffer(buf.nbytes, device=buf.device)  # doctest: +SKIP
        >>> ais.copy_async(host, buf)  # doctest: +SKIP

    Raises:
        TypeError: ``obj`` does not speak DLPack, or ``stream`` is not a Stream.
        ValueError: the array is in host memory (copy it into a :class:`HostBuffer`, then
            ``copy_async`` it to a DeviceBuffer), or on a device that is not CUDA's, or the
            stream is on another device.
        BufferError: the producer cannot export it, or it is not C-contiguous, or its dtype
            has no NumPy equivalent (view it as an integer type of its size first).

    Note:
        Reads the producer's DLPack capsule (versioned or legacy) and renames it as used, as
        the protocol asks; no CUDA call but the stream's use of the memory.
    """
    where = getattr(obj, "__dlpack_device__", None)
    export = getattr(obj, "__dlpack__", None)
    if not (callable(where) and callable(export)):
        raise TypeError(
            "from_dlpack() needs an array that speaks DLPack (__dlpack__ and "
            f"__dlpack_device__: a PyTorch tensor, a CuPy or JAX array); got {obj!r} of type "
            f"{type(obj).__name__}"
        )
    found = where()
    if not (isinstance(found, tuple) and len(found) == 2):
        raise TypeError(f"__dlpack_device__() must return (device_type, device_id), got {found!r}")
    kind = _check.integer(found[0], "the DLPack device type")
    index = _check.integer(found[1], "the DLPack device id", minimum=0)
    if kind in (DLDeviceType.CPU, DLDeviceType.CUDA_HOST):
        raise ValueError(
            "from_dlpack() wraps CUDA device memory, and this array is in host memory "
            f"(DLPack device type {kind}, {DLDeviceType(kind).name}): put it in an "
            "aiostream.HostBuffer "
            "(HostBuffer(a.nbytes, device=...).numpy(a.dtype, a.shape)[:] = a) and copy it "
            "to a DeviceBuffer with copy_async"
        )
    if kind != DLDeviceType.CUDA:
        raise ValueError(
            f"from_dlpack() wraps CUDA device memory (DLPack device type {int(DLDeviceType.CUDA)}"
            f"), and this array is on DLPack device type {kind}: move it to a CUDA device first"
        )
    dev = _resolve_device(Device("cuda", index))
    backend = _backends.get(dev.type)
    if not isinstance(backend, Interop):  # pragma: no cover - CUDA's backend has it
        raise ValueError(f"{dev} cannot wrap foreign memory")
    consumer = stream_or_current(stream, dev)
    if consumer.device != dev:
        raise ValueError(
            f"the array is on {dev}, the stream on {consumer.device}: pass a stream of {dev}"
        )
    handle = backend.stream_native(_objects.handle(consumer)) or 1  # 0: the legacy default
    try:
        capsule = export(stream=handle, max_version=_dlpack.VERSION)
    except TypeError:  # a producer of DLPack 0.x, without max_version
        capsule = export(stream=handle)
    imported = _dlpack.consume(capsule)
    try:
        if imported.device != (DLDeviceType.CUDA, index):
            raise BufferError(
                f"the capsule describes DLPack device {imported.device}, but "
                f"__dlpack_device__() said {(kind, index)}"
            )
        mem = backend.memory_wrap(index, imported.address, imported.nbytes, imported.release)
    except BaseException:
        imported.release()
        raise
    buf = DeviceBuffer._over(  # noqa: SLF001 (this module's class)
        dev, backend, mem, consumer, imported.dtype, imported.shape, obj
    )
    backend.memory_use(mem, _objects.handle(consumer))  # its release waits for this stream
    buf._read_only = imported.read_only  # noqa: SLF001 (this module's class)
    return buf


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
        ValueError: the sizes differ, both are host buffers, or devices do not match
            (between two devices, stage the copy through a ``HostBuffer``: the error says
            how).

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
        raise ValueError(
            f"copy_async copies within one device, got {src.device} and {dst.device}; stage "
            f"it through host memory: copy_async(staging, src) on a stream of {src.device}, "
            f"a stream of {dst.device} made to wait for an event recorded after it "
            f"(wait_event), then copy_async(dst, staging) there (staging = "
            f"aiostream.HostBuffer({src.nbytes}))"
        )
    stream = stream_or_current(stream, dev_buf.device)
    if stream.device != dev_buf.device:
        raise ValueError(
            f"the device buffer is on {dev_buf.device}, but the stream is on {stream.device}"
        )
    _objects.check_same_backend(stream, dst)
    _objects.check_same_backend(stream, src)
    if isinstance(dst, DeviceBuffer) and dst._read_only:  # noqa: SLF001 (this module's class)
        raise ValueError(
            "dst is read-only: its DLPack producer exported it so (the capsule's read-only "
            "flag); copy into a buffer of your own"
        )
    capturing = _capturing(stream)
    if capturing is not None:  # a node of a graph: the buffers live as long as it may run
        host = dst if isinstance(dst, HostBuffer) else src
        if isinstance(host, HostBuffer) and not host.pinned:
            raise pageable_copy(capturing)
        _captures.keep((stream.device.type, stream.device.index), dst, src)
    copy = _objects.backend(stream).copy
    dst_h, src_h = _objects.handle(dst), _objects.handle(src)
    _objects.submit(stream, f"copy {kind}", copy, dst_h, src_h, dst.nbytes, kind)
    if _hooks.listeners and capturing is None:  # a captured copy moves bytes at its replays
        _hooks.copied(str(stream.device), kind, dst.nbytes)


def _capturing(stream: Stream) -> str | None:
    """What messages call ``stream`` if it is capturing a graph, else None."""
    if _objects.capturing(stream):
        return f"stream {stream.stream_id} on {stream.device}"
    return None
