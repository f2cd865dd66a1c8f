"""Memory on the CUDA backend: pinned and pageable host memory, device memory, and copies.

The lifetime rules (PyTorch's caching-allocator contract, and the driver's for stream-ordered
allocation):

- Memory remembers the streams that used it: the stream it was allocated on, every stream an
  aiostream copy used it on, and every stream named with ``record_stream``. Freeing it records
  a marker on each of those streams, so the memory is released only after all the work they
  had been given by then, on the device, never with a host wait: device memory from a pool
  is freed stream-ordered (``cuMemFreeAsync``) after those markers; pinned host memory and
  device memory without pools wait in ``Device.freeing`` until their markers complete.
- A stream-ordered allocation may be used at once on its own stream; another stream's first
  use waits, on the device, for a marker recorded after the allocation (or nothing, once the
  host has seen that marker complete).
- Pinned host memory is portable, so a HostBuffer of one device serves copies on another's
  streams.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from ..._errors import CudaError, DeviceError
from .devices import Device, Devices
from .driver import MEMHOSTALLOC_PORTABLE, NOT_SUPPORTED, Driver
from .handles import Memory, Stream

__all__ = ["Memories"]

logger = logging.getLogger("aiostream")

_COPIES = {"h2d": "cuMemcpyHtoDAsync", "d2h": "cuMemcpyDtoHAsync", "d2d": "cuMemcpyDtoDAsync"}


class Memories:
    """Allocation, release and copies, for every device of one backend."""

    def __init__(self, drv: Driver, devices: Devices) -> None:
        self.drv = drv
        self.devices = devices
        #: memory aiostream did not allocate (a DLPack producer's, another process's), by id:
        #: what releases it in place of cuMemFree, once its users' work has completed
        self.releasers: dict[int, Callable[[Memory], None]] = {}

    # ------------------------------------------------------------------ allocation

    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> Memory:
        dev = self.devices.get(index)
        if not pinned:  # pageable: the driver stages copies from it before the call returns
            try:
                array = bytearray(nbytes)
            except (MemoryError, OverflowError):  # one error for host memory, pinned or not
                raise DeviceError(
                    f"cuda:{index}: cannot allocate {nbytes} bytes of host memory (the machine "
                    "does not have it)",
                    device=f"cuda:{index}",
                ) from None
            ptr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(array))
            return Memory(index, nbytes, ptr, device=False, array=array)
        with self.devices.lock:
            self._reap(dev)
            with dev.pushed:
                ptr = self.drv.check(
                    self.drv.cu.cuMemHostAlloc(max(nbytes, 1), MEMHOSTALLOC_PORTABLE),
                    index,
                    "cuMemHostAlloc",
                )
            mem = Memory(index, nbytes, int(ptr), device=False)
            dev.memory.add(mem)
        return mem

    @staticmethod
    def host_view(host: Memory) -> memoryview:
        if host.array is not None:
            return memoryview(host.array)
        if not host.nbytes:
            return memoryview(bytearray())
        return memoryview((ctypes.c_char * host.nbytes).from_address(host.ptr)).cast("B")

    def device_alloc(
        self, index: int, nbytes: int, stream: Stream, *, pooled: bool = True
    ) -> Memory:
        dev = self.devices.get(index)
        cu = self.drv.cu
        with self.devices.lock:
            self._reap(dev)
            with dev.pushed:
                mem = None
                if dev.pools and pooled:
                    result = cu.cuMemAllocAsync(max(nbytes, 1), stream.ptr)
                    if result[0] == NOT_SUPPORTED:  # no memory pools on this device
                        logger.debug("cuda:%d has no memory pools: using cuMemAlloc", index)
                        dev.pools = False
                    else:
                        ptr = self.drv.check(result, index, "cuMemAllocAsync")
                        mem = Memory(index, nbytes, int(ptr), device=True)
                        mem.pooled = True
                        stream.ops += 1
                if mem is None:
                    ptr = self.drv.check(cu.cuMemAlloc(max(nbytes, 1)), index, "cuMemAlloc")
                    mem = Memory(index, nbytes, int(ptr), device=True)
            dev.memory.add(mem)
            self._hold(mem, stream)
            if mem.pooled:
                try:
                    mem.alloc_marker = dev.record_marker(stream)
                except CudaError:
                    self.device_free(mem)
                    raise
        return mem

    # ------------------------------------------------------------------ use

    def use(self, mem: Memory, stream: Stream) -> None:
        """``stream`` uses ``mem`` from now on: its first use waits for the allocation, and
        the free waits for the stream's work (``record_stream``)."""
        if mem.array is not None or stream.key in mem.streams:
            return  # pageable memory is copied before the call returns; or known already
        with self.devices.lock:
            if stream.key in mem.streams:
                return
            marker = mem.alloc_marker
            if marker is not None:  # this stream's first use, not ordered after it yet
                dev = self.devices[mem.index]
                if dev.over(marker):  # the host has seen it complete: every stream may use it
                    mem.alloc_marker = None
                    dev.give_back(marker)
                elif stream.capture is not None:
                    # a wait on a record outside the capture would cross its boundary: each
                    # launch of the graph waits for the allocation instead
                    stream.capture.allocs.append(mem)
                else:
                    with dev.pushed:
                        self.drv.check(
                            self.drv.cu.cuStreamWaitEvent(stream.ptr, marker, 0),
                            stream.index,
                            "cuStreamWaitEvent",
                        )
                    stream.ops += 1
            self._hold(mem, stream)

    @staticmethod
    def _hold(mem: Memory, stream: Stream) -> None:
        """Remember that ``stream`` used ``mem`` (lock held): an owned stream is kept until
        the memory is freed, so the free can record on it."""
        mem.streams[stream.key] = stream
        stream.holds += 1

    def copy(self, stream: Stream, dst: Memory, src: Memory, nbytes: int, kind: str) -> None:
        cu = self.drv.cu
        call = _COPIES.get(kind)
        if call is None:
            raise ValueError(f"copy kind must be 'h2d', 'd2h' or 'd2d', got {kind!r}")
        self.use(dst, stream)
        self.use(src, stream)
        with self.devices[stream.index].pushed:
            if kind == "h2d":
                result = cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dst.ptr), src.ptr, nbytes, stream.ptr)
            elif kind == "d2h":
                result = cu.cuMemcpyDtoHAsync(dst.ptr, cu.CUdeviceptr(src.ptr), nbytes, stream.ptr)
            else:
                result = cu.cuMemcpyDtoDAsync(
                    cu.CUdeviceptr(dst.ptr), cu.CUdeviceptr(src.ptr), nbytes, stream.ptr
                )
        self.drv.check(result, stream.index, call)
        stream.ops += 1

    # ------------------------------------------------------------------ release

    def host_free(self, host: Memory) -> None:
        if host.array is not None:
            host.alive = False  # pragma: no mutate (equivalent: pageable memory's is never read)
            return
        self.device_free(host)  # pinned memory: released as device memory is

    def device_free(self, mem: Memory) -> None:
        if self.devices.closed:  # left to the exit at close (Devices.closed)
            return
        with self.devices.lock:
            dev = self.devices.retire(mem, "memory")
            if dev is not None:
                self.release(dev, mem)

    def release(self, dev: Device, mem: Memory) -> None:
        """Free ``mem``, which ``retire`` has marked released, after the work of every stream
        that used it (lock held; never raises: it runs in finalizers). Where one of them is
        capturing (no mark can be recorded there), once that capture has ended."""
        for stream in mem.streams.values():
            if stream.capture is not None:
                stream.capture.frees.append(mem)
                return
        marks: list[tuple[Device, object]] = []
        try:
            streams = [s for s in mem.streams.values() if s.alive]
            if mem.pooled and len(mem.streams) == 1 and streams:
                # used on its allocation stream only: freed there, in order with its work
                self._free_on(dev, mem, streams[0].ptr)
                streams[0].ops += 1
            else:
                marks = self._mark(streams)
                if mem.pooled:
                    self._free_after(dev, mem, marks)
                elif all(d.over(m) for d, m in marks):
                    self._free_now(dev, mem)
                else:
                    dev.freeing.append((mem, marks))
                    marks = []
        except CudaError as exc:  # a failed device releases nothing more; its context will
            self.drv.failed_release(str(exc))
        finally:
            for d, m in marks:  # recorded and waited for, or over: they may be recorded again
                d.give_back(m)
            self._drop(mem)

    def _mark(self, streams: list[Stream]) -> list[tuple[Device, object]]:
        """A marker recorded now on each stream: after the work it was given so far."""
        marks = []
        try:
            for stream in streams:
                dev = self.devices[stream.index]
                marks.append((dev, dev.record_marker(stream)))
        except CudaError:
            for d, m in marks:
                d.give_back(m)
            raise
        return marks

    def _free_on(self, dev: Device, mem: Memory, stream: object) -> None:
        cu = self.drv.cu
        with dev.pushed:
            self.drv.released(
                cu.cuMemFreeAsync(cu.CUdeviceptr(mem.ptr), stream), dev.index, "cuMemFreeAsync"
            )

    def _free_after(self, dev: Device, mem: Memory, marks: list[tuple[Device, object]]) -> None:
        """Pooled device memory, freed on the device's free stream after ``marks``."""
        if dev.free_stream is None:
            dev.free_stream = dev.internal_stream(dev.priorities[0])
        with dev.pushed:
            for _, marker in marks:
                self.drv.check(
                    self.drv.cu.cuStreamWaitEvent(dev.free_stream, marker, 0),
                    dev.index,
                    "cuStreamWaitEvent",
                )
        self._free_on(dev, mem, dev.free_stream)

    def _free_now(self, dev: Device, mem: Memory) -> None:
        """Free host memory, or device memory without a pool, whose users are done."""
        releaser = self.releasers.pop(id(mem), None)
        if releaser is not None:  # not allocated here: released by its owner's rule
            releaser(mem)
            return
        cu = self.drv.cu
        with dev.pushed:
            if mem.device:
                self.drv.released(cu.cuMemFree(cu.CUdeviceptr(mem.ptr)), dev.index, "cuMemFree")
            else:
                self.drv.released(cu.cuMemFreeHost(mem.ptr), dev.index, "cuMemFreeHost")

    def _drop(self, mem: Memory) -> None:
        """Forget the streams and the allocation marker of freed memory (lock held)."""
        if mem.alloc_marker is not None:
            self.devices[mem.index].give_back(mem.alloc_marker)
            mem.alloc_marker = None
        streams = list(mem.streams.values())
        mem.streams.clear()
        for stream in streams:
            stream.holds -= 1
            if stream.doomed and not stream.holds:
                dev = self.devices.retire(stream, "streams")
                if dev is not None:
                    dev.destroy_stream(stream)

    def _reap(self, dev: Device) -> None:
        """Free the memory whose users' work has completed (lock held)."""
        if not dev.freeing:
            return
        still = []
        for mem, marks in dev.freeing:
            if all(d.over(m) for d, m in marks):
                for d, m in marks:
                    d.give_back(m)
                try:
                    self._free_now(dev, mem)
                except CudaError as exc:
                    self.drv.failed_release(str(exc))
            else:
                still.append((mem, marks))
        dev.freeing = still

    def close(self, dev: Device) -> None:
        """At close (lock held): free what has finished being used; the rest waits in
        ``dev.freeing`` for :meth:`reap` (the device has gone idle) or the context's release
        at exit. Memory the program still holds stays in ``dev.memory``, never freed: its
        host views, and the tensors of libraries it was handed to, may still read it (an
        atexit handler registered before aiostream's, a daemon thread); it goes with its
        context at the process's exit."""
        self._reap(dev)
        if dev.memory:
            logger.debug(
                "cuda:%d: %d buffer(s) still held at close: left to the exit, with the context",
                dev.index,
                len(dev.memory),
            )

    def reap(self, dev: Device) -> None:
        """At close, once the device has nothing pending (lock held): free what waited for
        work that has completed since; what another device's pending work may still use is
        left in ``dev.freeing``, and keeps the context (see :meth:`Devices.close`)."""
        self._reap(dev)
        if dev.freeing:
            logger.debug(
                "cuda:%d: %d buffer(s) may still be in use by another device's pending work at "
                "close: they are left to the exit, with the context",
                dev.index,
                len(dev.freeing),
            )
