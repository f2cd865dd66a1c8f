"""Per-device state: the primary context, the pools of internal events and streams, and the
handles to release when the backend closes."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Hashable, Iterator
from importlib import resources
from typing import Any

from ..._errors import AiostreamError, CudaError
from .driver import MARKER_FLAGS, STREAM_NON_BLOCKING, SUCCESS, Driver
from .handles import Event, Memory, Stream

__all__ = ["Device", "Devices", "Lane"]

_SLEEP_KERNEL = b"aiostream_sleep"
_ptx_image: bytes | None = None
_lane_ids = itertools.count(1)


def sleep_ptx() -> bytes:
    """The sleep kernel's PTX (kernels/sleep.cu, compiled by tools/build_ptx.py), NUL-ended."""
    global _ptx_image
    if _ptx_image is None:
        ptx = resources.files(__package__).joinpath("kernels/sleep.ptx").read_bytes()
        _ptx_image = ptx + b"\0"
    return _ptx_image


class Lane:
    """A watcher stream lent to one lane of captures while any of them is pending."""

    __slots__ = ("key", "pending", "seq", "stream", "uid")

    def __init__(self, key: Hashable, stream: Any) -> None:
        self.key = key
        self.uid = next(_lane_ids)
        self.stream = stream
        self.pending = 0
        self.seq = itertools.count()


class Device:
    """One device: its context, pools and the handles to release at close.

    Methods that change the pools run with ``lock`` (the backend's, reentrant) held.
    """

    def __init__(
        self, drv: Driver, lock: threading.RLock, index: int, ctx: Any, priorities: tuple[int, int]
    ) -> None:
        self.drv = drv
        self.lock = lock
        self.index = index
        self.ctx = ctx
        self.priorities = priorities  # (least, greatest)
        self.default: Stream | None = None
        self.streams: set[Stream] = set()
        self.events: set[Event] = set()
        self.memory: set[Memory] = set()
        self.freeing: list[Memory] = []  # host memory waiting for its copies before cuMemFreeHost
        self.markers: list[Any] = []
        self.idle_watchers: list[Any] = []
        self.draining_watchers: list[Any] = []  # released with work pending; reused once idle
        self.lanes: dict[Hashable, Lane] = {}
        self.internal: list[tuple[str, Any]] = []  # every marker and stream made, for close
        self.free_stream: Any = None
        self.module: Any = None
        self.sleep: Any = None

    @contextlib.contextmanager
    def pushed(self) -> Iterator[None]:
        """Make the context current for a block, restoring the thread's own afterwards."""
        self.drv.check(self.drv.cu.cuCtxPushCurrent(self.ctx), self.index, "cuCtxPushCurrent")
        try:
            yield
        finally:
            self.drv.cu.cuCtxPopCurrent()

    def make_current(self) -> None:
        """Work on the default stream goes to the calling thread's current context: make it
        this device's."""
        self.drv.check(self.drv.cu.cuCtxSetCurrent(self.ctx), self.index, "cuCtxSetCurrent")

    def marker(self) -> Any:
        """An internal blocking-sync event, from the pool."""
        with self.lock:
            if self.markers:
                return self.markers.pop()
            with self.pushed():
                marker = self.drv.check(
                    self.drv.cu.cuEventCreate(MARKER_FLAGS), self.index, "cuEventCreate"
                )
            self.internal.append(("event", marker))
            return marker

    def internal_stream(self, priority: int) -> Any:
        """A new non-blocking stream for the backend's own use (lock held)."""
        with self.pushed():
            stream = self.drv.check(
                self.drv.cu.cuStreamCreateWithPriority(STREAM_NON_BLOCKING, priority),
                self.index,
                "cuStreamCreateWithPriority",
            )
        self.internal.append(("stream", stream))
        return stream

    def lane(self, key: Hashable) -> Lane:
        """The watcher stream of a lane of captures (lock held)."""
        lane = self.lanes.get(key)
        if lane is not None:
            return lane
        if not self.idle_watchers and self.draining_watchers:
            still: list[Any] = []
            for s in self.draining_watchers:
                (err,) = self.drv.cu.cuStreamQuery(s)
                (self.idle_watchers if err == SUCCESS else still).append(s)
            self.draining_watchers = still
        if self.idle_watchers:
            stream = self.idle_watchers.pop()
        else:
            stream = self.internal_stream(self.priorities[1])
        lane = self.lanes[key] = Lane(key, stream)
        return lane

    def end_lane(self, lane: Lane) -> None:
        """A lane with nothing pending gives its watcher stream back (lock held)."""
        if self.lanes.get(lane.key) is lane:
            del self.lanes[lane.key]
            (err,) = self.drv.cu.cuStreamQuery(lane.stream)
            (self.idle_watchers if err == SUCCESS else self.draining_watchers).append(lane.stream)

    def sleep_kernel(self) -> Any:
        """The sleep kernel's function, loaded on first use."""
        if self.sleep is None:
            cu = self.drv.cu
            with self.lock, self.pushed():
                if self.sleep is None:
                    module = self.drv.check(
                        cu.cuModuleLoadData(sleep_ptx()), self.index, "cuModuleLoadData"
                    )
                    self.module = module
                    self.sleep = self.drv.check(
                        cu.cuModuleGetFunction(module, _SLEEP_KERNEL),
                        self.index,
                        "cuModuleGetFunction",
                    )
        return self.sleep

    def release_all(self) -> None:
        """Release every handle still held, then the primary context (lock held; at close)."""
        cu = self.drv.cu
        for mem in self.freeing:
            if all(self.drv.over(m) for m in mem.uses.values()):
                cu.cuMemFreeHost(mem.ptr)
        self.freeing.clear()
        for event in self.events:
            event.alive = False
            cu.cuEventDestroy(event.ptr)
        for stream in self.streams:
            stream.alive = False
            cu.cuStreamDestroy(stream.ptr)
        for what, handle in self.internal:
            (cu.cuEventDestroy if what == "event" else cu.cuStreamDestroy)(handle)
        if self.module is not None:
            cu.cuModuleUnload(self.module)
        # Memory still in use is left to the context's release (or the process's exit).
        self.events.clear()
        self.streams.clear()
        self.internal.clear()
        cu.cuDevicePrimaryCtxRelease(self.index)


class Devices:
    """The devices in use, created on first use, under the backend's one (reentrant) lock."""

    def __init__(self, drv: Driver, count: int) -> None:
        self.drv = drv
        self.count = count
        self.lock = threading.RLock()
        self.by_index: dict[int, Device] = {}
        self.closed = False

    def get(self, index: int) -> Device:
        """The device ``index``, retaining its primary context on first use."""
        dev = self.by_index.get(index)
        if dev is not None:
            return dev
        with self.lock:
            if self.closed:
                raise AiostreamError("the CUDA backend was closed (the interpreter is exiting)")
            dev = self.by_index.get(index)
            if dev is None:
                dev = self._open(index)
                self.by_index[index] = dev
            return dev

    def _open(self, index: int) -> Device:
        drv, cu = self.drv, self.drv.cu
        cu_dev = drv.check(cu.cuDeviceGet(index), index, "cuDeviceGet")
        ctx = drv.check(cu.cuDevicePrimaryCtxRetain(cu_dev), index, "cuDevicePrimaryCtxRetain")
        dev = Device(drv, self.lock, index, ctx, (0, 0))
        try:
            with dev.pushed():
                err, least, greatest = cu.cuCtxGetStreamPriorityRange()
                if err != SUCCESS:
                    raise drv.error(err, index, "cuCtxGetStreamPriorityRange")
        except CudaError:
            cu.cuDevicePrimaryCtxRelease(cu_dev)
            raise
        dev.priorities = (int(least), int(greatest))
        return dev

    def __getitem__(self, index: int) -> Device:
        """A device already in use (its handles exist)."""
        return self.by_index[index]

    def follow(self, stream: Stream) -> None:
        """Work on the legacy default stream goes to the calling thread's current context:
        make it the stream's device's (other streams carry their context)."""
        if stream.default:
            self.by_index[stream.index].make_current()

    def retire(self, handle: Stream | Event | Memory, owner: str) -> Device | None:
        """Mark ``handle`` released (lock held): its device, if the caller must release it.

        None if it was released before, or if close() released it with its context.
        """
        if not handle.alive:
            return None
        handle.alive = False
        dev = self.by_index.get(handle.index)
        if dev is None or self.closed:
            return None
        getattr(dev, owner).discard(handle)
        return dev

    def close(self) -> bool:
        """Release everything; False if already closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            for dev in self.by_index.values():
                dev.release_all()
            return True
