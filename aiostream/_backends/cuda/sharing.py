"""Device memory shared with other libraries and other processes, on the CUDA backend.

- Ordering a consumer: a DLPack consumer's stream is made to wait, on the device, for the
  work that every stream that used the memory was given so far (a marker recorded on each,
  and ``cuStreamWaitEvent``); it does not become a user of the memory.
- Memory of another library (``from_dlpack``): not owned; freeing it runs its owner's release
  (the DLPack deleter) in place of ``cuMemFree``, once the work of every stream that used it
  has completed, by :class:`.memory.Memories`' rules.
- Memory of another process: ``cuIpcGetMemHandle`` of ``cuMemAlloc``'s memory (the driver
  shares no pool's that way), with this process's id, as the driver opens a handle in other
  processes only; ``cuIpcOpenMemHandle`` in the other process, whose stream waits for the
  exporter's interprocess event and then holds the memory as its allocation stream (another
  stream's first use waits for a marker after it); freeing it is ``cuIpcCloseMemHandle``.
- Events of another process: ``cuIpcGetEventHandle`` here, ``cuIpcOpenEventHandle`` there;
  either side may record them, so neither is private.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import weakref
from collections.abc import Callable

from ..._errors import CudaError
from .devices import Devices
from .driver import INVALID_VALUE, SUCCESS, Driver
from .handles import Event, Memory, Stream
from .memory import Memories

__all__ = ["Sharing"]

logger = logging.getLogger("aiostream")

#: cuIpcOpenMemHandle's one flag, which its documentation asks for
_IPC_LAZY_ENABLE_PEER_ACCESS = 0x1
_PID = struct.Struct("<I")
_DRIVER_HANDLE = 64


class Sharing:
    """DLPack consumers' streams, foreign memory and IPC, over one backend's memory."""

    def __init__(self, drv: Driver, devices: Devices, memories: Memories) -> None:
        self.drv = drv
        self.devices = devices
        self.memories = memories
        #: this process's events and memory by their driver IPC handles, which open here as
        #: the event or memory itself, shared
        self.exported: weakref.WeakValueDictionary[bytes, Event] = weakref.WeakValueDictionary()
        self.exported_memory: weakref.WeakValueDictionary[bytes, Memory] = (
            weakref.WeakValueDictionary()
        )

    def unshare(self, handle: Event | Memory) -> bool:
        """One owner of ``handle`` less, if it is shared (opened from its IPC handle in this
        process): True then, and it stays."""
        if self.devices.closed:  # released at close: never wait for the lock then
            return False
        with self.devices.lock:
            if handle.shares:
                handle.shares -= 1
                return True
            return False

    def order(self, mem: Memory, stream: Stream) -> None:
        """Make later work on ``stream`` wait, on the device, for the work that every other
        stream that used ``mem`` was given so far; never a host wait."""
        cu = self.drv.cu
        with self.devices.lock:
            others = [s for s in mem.streams.values() if s.alive and s.key != stream.key]
            marks = []
            try:
                for other in others:
                    dev = self.devices[other.index]
                    marks.append((dev, dev.record_marker(other)))
                with self.devices[stream.index].pushed:
                    for _, marker in marks:
                        self.drv.check(
                            cu.cuStreamWaitEvent(stream.ptr, marker, 0),
                            stream.index,
                            "cuStreamWaitEvent",
                        )
                if marks:
                    stream.ops += 1
            finally:
                for dev, marker in marks:  # the waits captured them: they may be reused
                    dev.give_back(marker)

    def wrap(self, index: int, ptr: int, nbytes: int, release: Callable[[], object]) -> Memory:
        """Device memory allocated elsewhere: freeing it calls ``release()`` once the work of
        every stream that used it has completed."""
        dev = self.devices.get(index)
        mem = Memory(index, nbytes, ptr, device=True)

        def releaser(_: Memory) -> None:
            try:
                release()
            except Exception as exc:  # noqa: BLE001 - a free never raises
                logger.warning("releasing memory of another library failed: %r", exc)

        with self.devices.lock:
            dev.memory.add(mem)
            self.memories.releasers[id(mem)] = releaser
        return mem

    def ipc_handle(self, mem: Memory) -> bytes:
        """This process's id and the driver's 64-byte handle of ``mem``."""
        if mem.pooled or not mem.device or id(mem) in self.memories.releasers:
            raise ValueError(
                "this memory cannot be shared with other processes: the driver shares memory "
                "of cuMemAlloc only; create the buffer with DeviceBuffer(nbytes, device, "
                "interprocess=True)"
            )
        cu = self.drv.cu
        with self.devices[mem.index].pushed:
            result = cu.cuIpcGetMemHandle(cu.CUdeviceptr(mem.ptr))
        handle = self.drv.check(result, mem.index, "cuIpcGetMemHandle")
        data = ctypes.string_at(handle.getPtr(), _DRIVER_HANDLE)
        self.exported_memory[data] = mem
        return _PID.pack(os.getpid()) + data

    def ipc_open(
        self, index: int, data: bytes, event: bytes, nbytes: int, stream: Stream
    ) -> Memory:
        """Open memory another process shared (``data`` from :meth:`ipc_handle`): ``stream``
        waits for the exporter's event (``event``), then holds it as its allocation stream."""
        if len(data) != _PID.size + _DRIVER_HANDLE or len(event) != _DRIVER_HANDLE:
            raise ValueError(
                "not an IPC handle of CUDA device memory: pass the bytes that "
                "DeviceBuffer.ipc_handle() returned in the exporting process"
            )
        (pid,) = _PID.unpack_from(data)
        if pid == os.getpid():
            return self._share(index, data[_PID.size :], event, nbytes, stream)
        cu = self.drv.cu
        mem_handle, event_handle = cu.CUipcMemHandle(), cu.CUipcEventHandle()
        ctypes.memmove(mem_handle.getPtr(), data[_PID.size :], _DRIVER_HANDLE)
        ctypes.memmove(event_handle.getPtr(), event, _DRIVER_HANDLE)
        dev = self.devices.get(index)
        with self.devices.lock, dev.pushed:
            after = self.drv.check(
                cu.cuIpcOpenEventHandle(event_handle), index, "cuIpcOpenEventHandle"
            )
            try:
                err, ptr = cu.cuIpcOpenMemHandle(mem_handle, _IPC_LAZY_ENABLE_PEER_ACCESS)
                if err == INVALID_VALUE:
                    raise ValueError(
                        "the driver cannot open this memory IPC handle "
                        "(CUDA_ERROR_INVALID_VALUE): pass the bytes that "
                        "DeviceBuffer.ipc_handle() returned in another process, while the "
                        "exported buffer is alive"
                    ) from self.drv.error(err, index, "cuIpcOpenMemHandle")
                if err != SUCCESS:
                    raise self.drv.error(err, index, "cuIpcOpenMemHandle")
                self._check_range(index, int(ptr), nbytes)
                mem = Memory(index, nbytes, int(ptr), device=True)
                dev.memory.add(mem)
                self.memories.releasers[id(mem)] = self._close
                self.memories.use(mem, stream)  # its allocation stream: freeing waits for it
                try:
                    dev.wait_for(stream, after)
                    mem.alloc_marker = dev.record_marker(stream)  # other streams wait for it
                except CudaError:
                    self.memories.device_free(mem)
                    raise
            finally:
                dev.release(cu.cuEventDestroy, after)  # the wait captured it
        return mem

    def _share(self, index: int, data: bytes, event: bytes, nbytes: int, stream: Stream) -> Memory:
        """Memory exported by this process, whose handle the driver opens elsewhere only: the
        memory itself, shared, ``stream`` ordered after the exporter's event as in another
        process."""
        with self.devices.lock:
            mem = self.exported_memory.get(data)
            if mem is None or not mem.alive:
                raise ValueError(
                    "the buffer behind this IPC handle, made in this process, no longer exists"
                )
            if mem.index != index or nbytes > mem.nbytes:
                raise ValueError(
                    f"this IPC handle is of {mem.nbytes} bytes on cuda:{mem.index}: pass the "
                    f"bytes that DeviceBuffer.ipc_handle() returned, unchanged, and open them "
                    f"on cuda:{mem.index}"
                )
            after = self.exported.get(event)
            if after is not None and after.alive:  # the exporter's event, shared too
                self.devices[index].wait_for(stream, after.ptr)
            self.memories.use(mem, stream)
            mem.shares += 1
            return mem

    def _check_range(self, index: int, ptr: int, nbytes: int) -> None:
        """Close the memory just opened at ``ptr`` and raise, unless it holds ``nbytes``: the
        size a handle claims is the exporter's word, and copies past the allocation would
        fault the context for good."""
        cu = self.drv.cu
        err, base, size = cu.cuMemGetAddressRange(cu.CUdeviceptr(ptr))
        if err == SUCCESS and int(base) + int(size) - ptr >= nbytes:
            return
        self.drv.released(cu.cuIpcCloseMemHandle(cu.CUdeviceptr(ptr)), index, "cuIpcCloseMemHandle")
        if err != SUCCESS:
            raise self.drv.error(err, index, "cuMemGetAddressRange")
        raise ValueError(
            f"this IPC handle claims {nbytes} bytes, but the memory it opens holds "
            f"{int(base) + int(size) - ptr}: pass the bytes that DeviceBuffer.ipc_handle() "
            "returned, unchanged"
        )

    def _close(self, mem: Memory) -> None:
        cu = self.drv.cu
        with self.devices[mem.index].pushed:
            self.drv.released(
                cu.cuIpcCloseMemHandle(cu.CUdeviceptr(mem.ptr)), mem.index, "cuIpcCloseMemHandle"
            )

    # ------------------------------------------------------------------ events

    def event_ipc_handle(self, event: Event) -> bytes:
        """The event's 64-byte IPC handle (``cuIpcGetEventHandle``); it is handed out."""
        event.private = False  # the process that opens it may record it
        with self.devices[event.index].pushed:
            result = self.drv.cu.cuIpcGetEventHandle(event.ptr)
        handle = self.drv.check(result, event.index, "cuIpcGetEventHandle")
        data = ctypes.string_at(handle.getPtr(), 64)
        self.exported[data] = event
        return data

    def event_from_ipc_handle(self, index: int, data: bytes) -> Event:
        """An event of another process, opened from its handle; owned (destroyed here). An
        event of this process is not opened (the driver promises nothing of that): the
        original is shared, and destroyed once its last owner lets it go."""
        with self.devices.lock:
            mine = self.exported.get(data)
            if mine is not None:
                if not mine.alive:
                    raise ValueError("the event behind this IPC handle no longer exists")
                if mine.index != index:
                    raise ValueError(
                        f"the IPC handle is of an event on cuda:{mine.index}, not cuda:{index}"
                    )
                mine.shares += 1
                return mine
        cu = self.drv.cu
        handle = cu.CUipcEventHandle()
        ctypes.memmove(handle.getPtr(), data, 64)
        dev = self.devices.get(index)
        with self.devices.lock, dev.pushed:
            err, ptr = cu.cuIpcOpenEventHandle(handle)
            if err == INVALID_VALUE:
                raise ValueError(
                    "the driver cannot open this event IPC handle (CUDA_ERROR_INVALID_VALUE): "
                    "pass the 64 bytes that Event.ipc_handle() returned in another process"
                ) from self.drv.error(err, index, "cuIpcOpenEventHandle")
            if err != SUCCESS:
                raise self.drv.error(err, index, "cuIpcOpenEventHandle")
            event = Event(ptr, index, owned=True)
            event.private = False  # the exporting process records it too
            dev.events.add(event)
        return event
