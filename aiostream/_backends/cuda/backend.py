"""The CUDA backend's face: the :class:`Backend` protocol over the driver and the devices, and
the parts it owns: the waits, the memory, the sharing and the graphs (the modules beside this
one)."""

from __future__ import annotations

import atexit
import ctypes
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from ... import _hooks
from ..base import Backend, Graphs, Interop
from .devices import Devices, handed_out
from .driver import (
    EVENT_BLOCKING_SYNC,
    EVENT_DISABLE_TIMING,
    EVENT_INTERPROCESS,
    STREAM_NON_BLOCKING,
    Driver,
    load_driver,
)
from .graphs import Capturing, Graph
from .handles import Event, Memory, Stream
from .memory import Memories
from .sharing import Sharing
from .waits import Target, Waits
from .watcher import watcher_stats

__all__ = ["CudaBackend"]

_DLPACK_CUDA = 2  # DLPack's kDLCUDA


class CudaBackend(Backend[Stream, Event, Memory, Target], Interop[Stream, Event], Graphs):
    """The CUDA driver behind ``cuda:N`` devices."""

    kind: ClassVar[str] = "cuda"
    #: the driver cannot say when work will complete: the waiter uses its strategies
    completion_times: ClassVar[bool] = False

    def __init__(self) -> None:
        self._drv = drv = Driver(load_driver())
        self._cu = cu = drv.cu
        self._devices = Devices(drv, int(cu.cuDeviceGetCount()[1]))
        self._waits = Waits(drv, self._devices)
        self._memory = Memories(drv, self._devices)
        self._sharing = Sharing(drv, self._devices, self._memory)
        self._graphs = Capturing(
            drv, self._devices, self._waits, self._memory.release, self._dropped
        )
        atexit.register(self.close)
        _hooks.enable_nvtx()  # record_function's ranges reach Nsight Systems too

    # ------------------------------------------------------------------ devices

    def device_count(self) -> int:
        return self._devices.count

    def device_name(self, index: int) -> str:
        check, cu = self._drv.check, self._cu
        dev = check(cu.cuDeviceGet(index), index, "cuDeviceGet")
        name = check(cu.cuDeviceGetName(256, dev), index, "cuDeviceGetName")
        return bytes(name).split(b"\0", 1)[0].decode(errors="replace").strip()

    def priority_range(self, index: int) -> tuple[int, int]:
        return self._devices.get(index).priorities

    # ------------------------------------------------------------------ streams

    def stream_create(self, index: int, priority: int) -> Stream:
        dev = self._devices.get(index)
        with self._devices.lock, dev.pushed:
            ptr = self._drv.check(
                self._cu.cuStreamCreateWithPriority(STREAM_NON_BLOCKING, priority),
                index,
                "cuStreamCreateWithPriority",
            )
            stream = Stream(ptr, index, owned=True)
            dev.streams.add(stream)
        return stream

    def stream_default(self, index: int) -> Stream:
        dev = self._devices.get(index)
        if dev.default is None:
            dev.default = Stream(self._cu.CUstream(0), index, owned=False)
        return dev.default

    def stream_wrap(self, index: int, handle: int) -> tuple[Stream, int]:
        """A stream made elsewhere (not owned: never destroyed here), and its priority."""
        dev = self._devices.get(index)
        if handle == 0:
            return self.stream_default(index), 0
        ptr = self._cu.CUstream(handle)
        with dev.pushed:
            priority = self._drv.check(
                self._cu.cuStreamGetPriority(ptr), index, "cuStreamGetPriority"
            )
        with self._devices.lock:
            for own in dev.streams:
                if own.id == handle:  # one of ours: work may come through the wrapper now
                    own.private = False
        return Stream(ptr, dev.index, owned=False), int(priority)

    def stream_native(self, stream: Stream) -> int:
        stream.private = False  # others may submit to it now (see Waits.event_target)
        return handed_out(stream)

    def stream_destroy(self, stream: Stream) -> None:
        if self._devices.closed:  # released at close (Devices.closed)
            return
        with self._devices.lock:
            if not stream.owned or stream.doomed:
                return
            if stream.capture is not None:  # destroying it would break the capture
                stream.capture.dropped.append(stream)  # destroyed at the capture's end
                stream.doomed = True
                return
            if stream.holds:  # memory will record on it when freed: destroyed after that
                stream.doomed = True
                return
            dev = self._devices.retire(stream, "streams")
            if dev is not None:
                dev.destroy_stream(stream)

    def _dropped(self, stream: Stream) -> None:
        """A stream the program dropped while it captured, its capture ended (lock held)."""
        stream.doomed = False
        self.stream_destroy(stream)

    def stream_id(self, stream: Stream) -> int:
        return stream.id

    def stream_query(self, stream: Stream) -> bool:
        self._waits.check_not_capturing(stream)
        with self._devices[stream.index].pushed:
            (err,) = self._cu.cuStreamQuery(stream.ptr)
        if self._drv.ready(err, stream.index, "cuStreamQuery"):
            return True
        return self._waits.idle(stream)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        self._graphs.check_wait(stream, event)
        self._devices[stream.index].wait_for(stream, event.ptr)

    def stream_target(self, stream: Stream, wake: bool) -> Target:
        return self._waits.stream_target(stream, wake)

    # ------------------------------------------------------------------ events

    def event_create(
        self, index: int, *, timing: bool, blocking: bool, interprocess: bool
    ) -> Event:
        flags = 0 if timing else EVENT_DISABLE_TIMING
        if blocking:
            flags |= EVENT_BLOCKING_SYNC
        if interprocess:
            flags |= EVENT_INTERPROCESS
        dev = self._devices.get(index)
        drv, lock = self._drv, self._devices.lock

        def make(event: Event) -> Any:
            """The driver's event, made on its first use (its record's, which it shares a
            push with)."""
            with lock:
                if event.raw is None:
                    with dev.pushed.safe:
                        event.raw = drv.check(self._cu.cuEventCreate(flags), index, "cuEventCreate")
                return event.raw

        with lock:
            event = Event(None, index, owned=True, make=make)
            dev.events.add(event)
        return event

    def event_wrap(self, index: int, handle: int) -> Event:
        """An event made elsewhere (not owned: never destroyed here)."""
        self._devices.get(index)
        return Event(self._cu.CUevent(handle), index, owned=False)

    def event_destroy(self, event: Event) -> None:
        if self._devices.closed:  # released at close (Devices.closed)
            return
        with self._devices.lock:
            if not event.owned or self._sharing.unshare(event):
                return
            self._waits.forget(event)
            dev = self._devices.retire(event, "events")
            if dev is None or self._waits.keep_recorded(event):
                return
            if event.raw is None:
                return  # never made
            if event.private:  # its handle never left: destroyed with the next push
                dev.doom_event(event)
            else:
                dev.release(self._cu.cuEventDestroy, event.ptr, safe=True)

    def event_id(self, event: Event) -> int:
        return event.id

    def event_native(self, event: Event) -> int:
        event.private = False  # others may record it now: see Waits.query
        return handed_out(event)

    def event_record(self, event: Event, stream: Stream) -> None:
        self._waits.record(event, stream)

    def event_query(self, event: Event, quick: bool = False) -> bool:
        return self._waits.query(event, quick)

    def event_target(self, event: Event, wake: bool) -> Target:
        return self._waits.event_target(event, wake)

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        return self._waits.elapsed_ms(start, end)

    def event_ipc_handle(self, event: Event) -> bytes:
        return self._sharing.event_ipc_handle(event)

    def event_from_ipc_handle(self, index: int, data: bytes) -> Event:
        return self._sharing.event_from_ipc_handle(index, data)

    # ------------------------------------------------------------------ device work

    def delay(self, stream: Stream, seconds: float) -> None:
        dev = self._devices[stream.index]
        kernel = dev.sleep_kernel()
        ns = round(seconds * 1e9)
        with dev.pushed.around(stream.ptr):
            result = self._cu.cuLaunchKernel(
                kernel, 1, 1, 1, 1, 1, 1, 0, stream.ptr, ((ns,), (ctypes.c_uint64,)), 0
            )
        self._drv.check(result, stream.index, "cuLaunchKernel")
        stream.ops += 1
        dev.watch_unowned(stream)  # a stream of another's: close is to see this kernel

    # ------------------------------------------------------------------ memory and copies

    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> Memory:
        return self._memory.host_alloc(index, nbytes, pinned=pinned)

    def host_view(self, host: Memory) -> memoryview:
        return self._memory.host_view(host)

    def host_access(self, host: Memory) -> None:
        """Nothing to check: the driver has no race detector (the virtual backend does)."""

    def host_free(self, host: Memory) -> None:
        self._memory.host_free(host)

    def device_alloc(self, index: int, nbytes: int, stream: Stream) -> Memory:
        return self._memory.device_alloc(index, nbytes, stream)

    def device_free(self, mem: Memory) -> None:
        if not self._sharing.unshare(mem):
            self._memory.device_free(mem)

    def memory_use(self, mem: Memory, stream: Stream) -> None:
        self._memory.use(mem, stream)

    def device_ptr(self, mem: Memory) -> int:
        return mem.ptr

    def copy(self, stream: Stream, dst: Memory, src: Memory, nbytes: int, kind: str) -> None:
        self._memory.copy(stream, dst, src, nbytes, kind)

    # ------------------------------------------------------------------ sharing memory

    def dlpack_device(self, index: int) -> tuple[int, int]:
        return (_DLPACK_CUDA, index)

    def memory_export(self, mem: Memory) -> int:
        return mem.ptr

    def memory_wait(self, mem: Memory, stream: Stream) -> None:
        self._sharing.order(mem, stream)

    def memory_wrap(
        self, index: int, ptr: int, nbytes: int, release: Callable[[], object]
    ) -> Memory:
        return self._sharing.wrap(index, ptr, nbytes, release)

    def device_alloc_interprocess(self, index: int, nbytes: int, stream: Stream) -> Memory:
        return self._memory.device_alloc(index, nbytes, stream, pooled=False)

    def memory_ipc_handle(self, mem: Memory) -> bytes:
        return self._sharing.ipc_handle(mem)

    def memory_from_ipc_handle(
        self, index: int, data: bytes, event: bytes, nbytes: int, stream: Stream
    ) -> Memory:
        return self._sharing.ipc_open(index, data, event, nbytes, stream)

    # ------------------------------------------------------------------ graphs

    def capture_begin(self, stream: Stream, mode: str) -> None:
        self._graphs.begin(stream, mode)

    def capture_end(self, stream: Stream) -> Graph:
        return self._graphs.end(stream)

    def stream_capturing(self, stream: Stream) -> bool:
        return self._graphs.capturing(stream)

    def graph_nodes(self, graph: Graph) -> int:
        return graph.nodes

    def graph_launch(self, stream: Stream, graph: Graph) -> None:
        self._graphs.launch(stream, graph)

    def graph_destroy(self, graph: Graph) -> None:
        self._graphs.destroy(graph)

    def graph_handles(self, graph: Graph) -> tuple[int, int]:
        return self._graphs.handles(graph)

    def graph_dump(self, graph: Graph, path: str, verbose: bool) -> None:
        self._graphs.dump(graph, path, verbose)

    def graph_update(self, graph: Graph, source: Graph) -> str | None:
        return self._graphs.update(graph, source)

    # ------------------------------------------------------------------ waiting

    def wake_hint(self, index: int) -> float | None:
        return None  # the driver gives no completion times: see completion_times

    def subscribe(self, index: int, callback: Callable[[], None]) -> Callable[[], None]:
        return _nothing

    def wait_blocking(self, target: Target) -> None:
        """Wait in this thread for the watcher's word that the work is done (timed waits: Ctrl-C
        gets through), or raise the device's error; a word that finds neither is waited past."""
        while True:
            woken = threading.Event()
            target.watch(woken.set)
            while not woken.wait(0.25):
                pass
            if target.done():
                return

    def sweep(self, index: int) -> None:
        """One sweep of device ``index``'s completion flags, as its watcher makes one (the
        benchmarks time it)."""
        watcher = self._devices.get(index).watcher
        with watcher.lock:
            watcher.collect()

    def held(self, index: int) -> dict[str, int]:
        """What device ``index`` holds for aiostream's own use, beyond the user's handles:
        internal streams and events, waits watched, completion-flag slots and chunks."""
        dev = self._devices.get(index)
        with self._devices.lock:
            dev.flush()  # the events released by the program go now
            streams = sum(1 for kind in dev.internal.values() if kind == "stream")
            graphs = sum(1 for kind in dev.internal.values() if kind in ("graph", "cugraph"))
            events = len(dev.internal) - streams - graphs + (dev.watcher.health.event is not None)
        watched, slots, chunks = watcher_stats(dev.watcher)
        return {
            "streams": streams,
            "events": events,
            "watched": watched,
            "slots": slots,
            "chunks": chunks,
        }

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Release every handle but the memory still held, then the primary contexts that
        nothing keeps (idempotent; runs at exit); every use raises after it."""
        self._devices.close(self._memory.close, self._memory.reap)
        atexit.unregister(self.close)


def _nothing() -> None:
    pass
