"""Memory on the CUDA backend: pinned and pageable host memory, stream-ordered device memory,
and copies. Memory freed while a copy still uses it is released when the copy is done: each
buffer keeps, per stream, a marker recorded after its last copy there."""

from __future__ import annotations

import ctypes

from .devices import Device, Devices
from .driver import Driver
from .handles import Memory, Stream

__all__ = ["Memories"]

_COPIES = {"h2d": "cuMemcpyHtoDAsync", "d2h": "cuMemcpyDtoHAsync", "d2d": "cuMemcpyDtoDAsync"}


class Memories:
    """Allocation, release and copies, for every device of one backend."""

    def __init__(self, drv: Driver, devices: Devices) -> None:
        self.drv = drv
        self.devices = devices

    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> Memory:
        dev = self.devices.get(index)
        if not pinned:  # pageable: the driver stages copies from it before the call returns
            array = bytearray(nbytes)
            ptr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(array)) if nbytes else 0
            return Memory(index, nbytes, ptr, device=False, array=array)
        with self.devices.lock, dev.pushed():
            self._reap(dev)
            ptr = self.drv.check(
                self.drv.cu.cuMemHostAlloc(max(nbytes, 1), 0), index, "cuMemHostAlloc"
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

    def host_free(self, host: Memory) -> None:
        if host.array is not None:
            host.alive = False
            return
        with self.devices.lock:
            dev = self.devices.retire(host, "memory")
            if dev is not None:
                dev.freeing.append(host)  # freed by _reap once its copies have completed
                self._reap(dev)

    def _reap(self, dev: Device) -> None:
        """Free host memory whose copies have completed (lock held)."""
        still = []
        for mem in dev.freeing:
            if all(self.drv.over(m) for m in mem.uses.values()):
                self._drop_uses(dev, mem)
                self.drv.quiet(self.drv.cu.cuMemFreeHost(mem.ptr), dev.index, "cuMemFreeHost")
            else:
                still.append(mem)
        dev.freeing = still

    @staticmethod
    def _drop_uses(dev: Device, mem: Memory) -> None:
        dev.markers.extend(mem.uses.values())
        mem.uses.clear()

    def device_alloc(self, index: int, nbytes: int, stream: Stream) -> Memory:
        dev = self.devices.get(index)
        if stream.default:
            dev.make_current()
        with self.devices.lock, dev.pushed():
            ptr = self.drv.check(
                self.drv.cu.cuMemAllocAsync(max(nbytes, 1), stream.ptr), index, "cuMemAllocAsync"
            )
            mem = Memory(index, nbytes, int(ptr), device=True)
            dev.memory.add(mem)
        self._used(mem, stream)
        return mem

    def device_free(self, mem: Memory) -> None:
        """Free on an internal stream, after every copy that used the memory (on the device)."""
        drv, cu = self.drv, self.drv.cu
        with self.devices.lock:
            dev = self.devices.retire(mem, "memory")
            if dev is None:
                return
            if dev.free_stream is None:
                dev.free_stream = dev.internal_stream(dev.priorities[0])
            for marker in mem.uses.values():
                drv.quiet(
                    cu.cuStreamWaitEvent(dev.free_stream, marker, 0), dev.index, "cuStreamWaitEvent"
                )
            self._drop_uses(dev, mem)
            drv.quiet(
                cu.cuMemFreeAsync(cu.CUdeviceptr(mem.ptr), dev.free_stream),
                dev.index,
                "cuMemFreeAsync",
            )

    def copy(self, stream: Stream, dst: Memory, src: Memory, nbytes: int, kind: str) -> None:
        cu = self.drv.cu
        call = _COPIES.get(kind)
        if call is None:
            raise ValueError(f"copy kind must be 'h2d', 'd2h' or 'd2d', got {kind!r}")
        self.devices.follow(stream)
        if kind == "h2d":
            result = cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dst.ptr), src.ptr, nbytes, stream.ptr)
        elif kind == "d2h":
            result = cu.cuMemcpyDtoHAsync(dst.ptr, cu.CUdeviceptr(src.ptr), nbytes, stream.ptr)
        else:
            result = cu.cuMemcpyDtoDAsync(
                cu.CUdeviceptr(dst.ptr), cu.CUdeviceptr(src.ptr), nbytes, stream.ptr
            )
        self.drv.check(result, stream.index, call)
        self._used(dst, stream)
        self._used(src, stream)

    def _used(self, mem: Memory, stream: Stream) -> None:
        """Remember the point on ``stream`` after which ``mem`` is no longer in use there."""
        if mem.array is not None:
            return  # pageable memory: the driver copies it before the call returns
        with self.devices.lock:
            marker = mem.uses.get(stream.id)
            if marker is None:
                marker = mem.uses[stream.id] = self.devices[mem.index].marker()
        self.drv.check(self.drv.cu.cuEventRecord(marker, stream.ptr), stream.index, "cuEventRecord")
