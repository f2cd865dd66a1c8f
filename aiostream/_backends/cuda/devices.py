"""Per-device state: the primary context, the internal events (markers, a pool of at most
``MARKER_POOL`` kept between uses) and the one internal stream (frees ordered after several
streams), the completion watcher, and the handles to release when the backend closes.

Every driver call that touches a device's objects runs inside ``with dev.pushed:``, which
pushes the device's primary context on the calling thread's context stack and pops it after:
the call finds its context current whatever thread makes it (a loop, a worker, a finalizer
run by the garbage collector), and the thread's own current context, which PyTorch and CuPy
read as their current device, is left as it was.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from importlib import resources
from typing import Any

from ..._errors import AiostreamError, CudaError
from .driver import (
    ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
    MARKER_FLAGS,
    NOT_READY,
    STREAM_NON_BLOCKING,
    SUCCESS,
    Driver,
)
from .handles import Event, Memory, Stream
from .watcher import CLOSED, Watcher

__all__ = ["CLOSED", "Device", "Devices", "Pushed", "handed_out"]

logger = logging.getLogger("aiostream")

MARKER_POOL = 8  #: idle markers a device keeps for reuse; the rest are destroyed
DOOMED_MAX = 32  #: events released by the program whose destruction waits for a push
_SLEEP_KERNEL = b"aiostream_sleep"
_ptx_image: bytes | None = None


def handed_out(handle: Stream | Event) -> int:
    """The driver's handle of ``handle``, for another library; raise once the backend has
    released it at close (it names nothing then, or another object the driver made since)."""
    if not handle.alive:
        raise AiostreamError(CLOSED)
    return handle.id


def sleep_ptx() -> bytes:
    """The sleep kernel's PTX (kernels/sleep.cu, compiled by tools/build_ptx.py), NUL-ended."""
    global _ptx_image
    if _ptx_image is None:
        ptx = resources.files(__package__).joinpath("kernels/sleep.ptx").read_bytes()
        _ptx_image = ptx + b"\0"
    return _ptx_image


class Pushed:
    """``with dev.pushed:`` the device's context is current on this thread, then the
    thread's own again (``cuCtxPushCurrent`` / ``cuCtxPopCurrent``), and the thread's capture
    interaction mode RELAXED, then its own again (:meth:`Driver.relax`). ``with dev.pushed.safe:``
    leaves the capture mode alone: for calls that are never *potentially unsafe* during
    another thread's capture (launches, event records, stream memory writes and host
    functions on a stream other than the legacy one; creating and destroying events), which
    saves two driver calls. Both are reentrant: a block inside another of the same device on
    the same thread pushes nothing (its context is current already), so an operation's
    calls share one push and one pop. Once the backend has released the device's handles
    (``closed``), they refuse: a handle the program still holds names nothing, or another
    object the driver made since."""

    __slots__ = ("closed", "ctx", "cu", "doomed", "drv", "index", "safe")

    def __init__(self, drv: Driver, ctx: Any, index: int) -> None:
        self.drv = drv
        self.cu = drv.cu
        self.ctx = ctx
        self.index = index
        self.closed = False
        self.safe = _Safe(self)
        #: events released by the program, destroyed at the next push (``Device.doom_event``)
        self.doomed: list[Any] = []

    def __enter__(self) -> None:
        if self.closed:
            raise AiostreamError(CLOSED)
        self.drv.relax()  # no call of ours breaks a capture another thread has under way
        try:
            self.push()
        except BaseException:
            self.drv.restore()
            raise

    def __exit__(self, *exc: object) -> None:
        self.pop()
        self.drv.restore()

    def push(self) -> None:
        """Make the context current on this thread, unless a block of this device's already
        made it so (the innermost of this thread's open blocks is one of ours)."""
        levels = _levels()
        if levels and levels[-1][0] is self:
            levels.append((self, False))
            return
        (err,) = self.cu.cuCtxPushCurrent(self.ctx)
        if err != SUCCESS:
            raise self.drv.error(err, self.index, "cuCtxPushCurrent")
        levels.append((self, True))
        doomed = self.doomed
        while doomed:  # (pop: a finalizer on another thread may append meanwhile)
            self.drv.released(self.cu.cuEventDestroy(doomed.pop()), self.index, "cuEventDestroy")

    def pop(self) -> None:
        _, pushed = _levels().pop()
        if pushed:
            self.cu.cuCtxPopCurrent()

    def around(self, stream: Any) -> Pushed | _Safe:
        """The block for a call that is safe on any stream but the legacy one (``stream``,
        a ``CUstream`` or its int): there it synchronizes implicitly, potentially unsafe."""
        return self if int(stream) == 0 else self.safe


class _Safe:
    """``with dev.pushed.safe:`` (see :class:`Pushed`)."""

    __slots__ = ("pushed",)

    def __init__(self, pushed: Pushed) -> None:
        self.pushed = pushed

    def __enter__(self) -> None:
        if self.pushed.closed:
            raise AiostreamError(CLOSED)
        self.pushed.push()

    def __exit__(self, *exc: object) -> None:
        self.pushed.pop()


#: per thread: the open blocks of every device (innermost last), each with whether it pushed
_open = threading.local()


def _levels() -> list[tuple[Pushed, bool]]:
    try:
        levels: list[tuple[Pushed, bool]] = _open.levels
    except AttributeError:
        levels = _open.levels = []
    return levels


class Device:
    """One device: its context, pools and the handles to release at close.

    Methods that change the pools run with ``lock`` (the backend's, reentrant) held.
    """

    def __init__(
        self,
        lock: threading.RLock,
        pushed: Pushed,
        priorities: tuple[int, int],
        pools: bool,
    ) -> None:
        self.drv = pushed.drv
        self.lock = lock
        self.index = pushed.index
        self.pushed = pushed  # the context: pushed around each driver call
        self.priorities = priorities  # (least, greatest)
        self.pools = pools  # stream-ordered allocation (cuMemAllocAsync) works here
        self.default: Stream | None = None
        self.streams: set[Stream] = set()
        self.events: set[Event] = set()
        self.memory: set[Memory] = set()
        #: memory freed while work recorded at the free may still use it, with those markers:
        #: pinned host memory, and device memory without pools, released once they complete
        self.freeing: list[tuple[Memory, list[tuple[Device, Any]]]] = []
        #: internal events free to record: frees' and allocations' orderings (at most
        #: ``MARKER_POOL``; more are destroyed when given back)
        self.markers: list[Any] = []
        #: every marker ("event"), stream, executable graph ("graph") and the graph it runs the
        #: work of ("cugraph") alive, for close
        self.internal: dict[Any, str] = {}
        self.free_stream: Any = None  # frees ordered after several streams' work
        #: markers recorded on streams as they were destroyed, until they complete: work
        #: still pending on a stream gone, which close must see
        self.tails: list[Any] = []
        self.module: Any = None
        self.sleep: Any = None
        self.watcher = Watcher(self)

    def marker(self) -> Any:
        """An internal blocking-sync event, from the pool."""
        with self.lock:
            if self.markers:
                return self.markers.pop()
            with self.pushed:
                marker = self.drv.check(
                    self.drv.cu.cuEventCreate(MARKER_FLAGS), self.index, "cuEventCreate"
                )
            # (internal kinds are only compared with "stream" and the graphs' kinds)
            self.internal[marker] = "event"  # pragma: no mutate (equivalent: see above)
            return marker

    def doom_event(self, event: Event) -> None:
        """Destroy ``event``, released by the program (lock held): with the next push of the
        device's context, on any thread, so that its call shares that push; at once when
        ``DOOMED_MAX`` wait."""
        doomed = self.pushed.doomed
        doomed.append(event.ptr)
        if len(doomed) >= DOOMED_MAX:
            self.flush()

    def flush(self) -> None:
        """Destroy the events doomed so far (``doom_event``); never raises."""
        if self.pushed.doomed and not self.pushed.closed:
            try:
                with self.pushed.safe:  # (the push destroys them)
                    pass
            except CudaError as exc:
                self.drv.failed_release(str(exc))

    def give_back(self, marker: Any) -> None:
        """Put ``marker`` back in the pool, or destroy it when the pool is full (a pending
        record of it completes all the same). One given back after close was destroyed with
        the rest: it is neither kept nor destroyed again."""
        with self.lock:
            if marker not in self.internal:
                return
            if len(self.markers) < MARKER_POOL:
                self.markers.append(marker)
                return
            del self.internal[marker]
            self.release(self.drv.cu.cuEventDestroy, marker)

    def record_marker(self, stream: Stream) -> Any:
        """A marker recorded on ``stream`` now: it completes after the work submitted so far."""
        marker = self.marker()
        try:
            with self.pushed:
                self.drv.check(
                    self.drv.cu.cuEventRecord(marker, stream.ptr), self.index, "cuEventRecord"
                )
        except CudaError:
            self.give_back(marker)
            raise
        return marker

    def wait_for(self, stream: Stream, event: Any) -> None:
        """Later work on ``stream`` waits, on the device, for ``event``'s last record."""
        with self.pushed:
            result = self.drv.cu.cuStreamWaitEvent(stream.ptr, event, 0)
        self.drv.check(result, self.index, "cuStreamWaitEvent")
        stream.ops += 1

    def over(self, marker: Any) -> bool:
        """Whether ``marker``'s work is over, completed or failed; never raises."""
        try:
            with self.pushed:
                (err,) = self.drv.cu.cuEventQuery(marker)
        except CudaError:
            return True  # the context is gone: nothing runs any more
        return bool(err != NOT_READY)

    def let_go_recorded(self, stream: Stream) -> None:
        """``stream`` records again or goes (lock held): destroy the event kept as its last
        record (``Waits.keep_recorded``), if the program had released it."""
        recorded, stream.recorded = stream.recorded, None
        if recorded is not None and recorded[0].kept:
            event = recorded[0]
            event.kept = False
            if self.internal.pop(event.ptr, None) is not None:
                self.release(self.drv.cu.cuEventDestroy, event.ptr)

    def destroy_stream(self, stream: Stream) -> None:
        """Destroy ``stream``, one of aiostream's, retired (lock held; never raises). The
        driver lets its pending work run on: if it has some, a marker recorded on it first is
        kept in ``tails`` until it completes, so that close still sees that work."""
        self.let_go_recorded(stream)
        self.tails = self._pending_tails()
        tail = None
        try:
            with self.pushed:
                (err,) = self.drv.cu.cuStreamQuery(stream.ptr)
            if err == NOT_READY:
                tail = self.record_marker(stream)
        except CudaError as exc:  # a failed context: nothing of it runs any more
            self.drv.failed_release(str(exc))
        self.release(self.drv.cu.cuStreamDestroy, stream.ptr)
        if tail is not None:
            self.tails.append(tail)

    def watch_unowned(self, stream: Stream) -> None:
        """Work of aiostream's (the sleep kernel) was just submitted to ``stream``. Close sees
        whether aiostream's streams and the null stream are idle, not a stream made
        elsewhere (its owner may have destroyed it): there, a marker after that work joins
        the tails, so that close sees it pending and leaves the kernel's module alone."""
        if stream.owned or stream is self.default:
            return
        with self.lock:
            self.tails = self._pending_tails()
            self.tails.append(self.record_marker(stream))

    def _pending_tails(self) -> list[Any]:
        """The tails still pending; the others go back to the pool."""
        pending = []
        for tail in self.tails:
            if self.over(tail):
                self.give_back(tail)
            else:
                pending.append(tail)
        return pending

    def internal_stream(self, priority: int) -> Any:
        """A new non-blocking stream for the backend's own use (lock held)."""
        with self.pushed:
            stream = self.drv.check(
                self.drv.cu.cuStreamCreateWithPriority(STREAM_NON_BLOCKING, priority),
                self.index,
                "cuStreamCreateWithPriority",
            )
        self.internal[stream] = "stream"
        return stream

    def sleep_kernel(self) -> Any:
        """The sleep kernel's function, loaded on first use."""
        if self.sleep is None:
            cu = self.drv.cu
            with self.lock, self.pushed:
                if self.module is None:  # kept if the function's lookup fails: tried again
                    self.module = self.drv.check(
                        cu.cuModuleLoadData(sleep_ptx()), self.index, "cuModuleLoadData"
                    )
                if self.sleep is None:
                    self.sleep = self.drv.check(
                        cu.cuModuleGetFunction(self.module, _SLEEP_KERNEL),
                        self.index,
                        "cuModuleGetFunction",
                    )
        return self.sleep

    def release(
        self, call: Callable[[Any], tuple[Any, ...]], handle: Any, safe: bool = False
    ) -> None:
        """``call(handle)``, a driver call that releases something (``cuStreamDestroy``...),
        with the context pushed (``safe``: a call never potentially unsafe during a capture,
        ``cuEventDestroy``: the capture mode left alone); never raises (see
        :meth:`Driver.released`)."""
        try:
            with self.pushed.safe if safe else self.pushed:
                result = call(handle)
        except CudaError as exc:
            self.drv.failed_release(str(exc))
        else:
            self.drv.released(result, self.index, call.__name__)

    def busy(self) -> bool:
        """Whether work is still pending on a stream aiostream knows of on this device."""
        cu = self.drv.cu
        streams = [s.ptr for s in self.streams] + [
            h for h, kind in self.internal.items() if kind == "stream"
        ]
        try:
            with self.pushed:
                return any(cu.cuStreamQuery(s)[0] == NOT_READY for s in [cu.CUstream(0), *streams])
        except CudaError:
            return False  # the context cannot be made current: nothing runs in it

    def pending(self) -> bool:
        """Whether work is still pending on this device (lock held; at close): on a stream
        not idle, or on one destroyed (its tail marker, or a completion flag whose value has
        not landed)."""
        flags = self.watcher.flags
        flags.sweep()
        if self.busy():
            return True
        self.tails = self._pending_tails()  # after the streams: each seen idle says no more
        return bool(self.tails) or flags.used() > 0

    def release_all(self, keep_context: bool, work_pending: bool) -> None:
        """Release every handle still held, then the primary context (lock held; at close,
        after the memory). No thread of aiostream's ever blocks in the driver on a handle, so
        none is pulled from under one. With ``keep_context`` (work that may still use the
        context is pending: a kernel that runs on, or hangs, or another device's work on this
        one's memory), the context is left to the process's exit, which never waits for that
        work (releasing the context could), with the memory still in use, the completion
        flags still to be written; with ``work_pending`` (on this device), the sleep kernel's
        module too (unloading it waits for its kernels)."""
        drv, cu = self.drv, self.drv.cu
        self.freeing.clear()  # what is left is in use: it goes with the context at exit
        self.watcher.flags.close()
        try:
            with self.pushed:
                for event in self.events:  # left alive: retire refuses every handle once closed
                    event.alive = False
                    if event.raw is not None:  # else never made
                        drv.released(cu.cuEventDestroy(event.raw), self.index, "cuEventDestroy")
                for stream in self.streams:
                    stream.alive = False
                    drv.released(cu.cuStreamDestroy(stream.ptr), self.index, "cuStreamDestroy")
                for handle, what in self.internal.items():
                    if what == "stream":
                        drv.released(cu.cuStreamDestroy(handle), self.index, "cuStreamDestroy")
                    elif what == "graph":
                        drv.released(
                            cu.cuGraphExecDestroy(handle), self.index, "cuGraphExecDestroy"
                        )
                    elif what == "cugraph":  # the graph an executable graph was made from
                        drv.released(cu.cuGraphDestroy(handle), self.index, "cuGraphDestroy")
                    else:
                        drv.released(cu.cuEventDestroy(handle), self.index, "cuEventDestroy")
                # a GPU's driver waits for a module's kernels still running before it unloads
                # it (a hung one would hold the exit): with work pending, the sleep kernel's
                # module is left with the context
                if self.module is not None and not work_pending:
                    drv.released(cu.cuModuleUnload(self.module), self.index, "cuModuleUnload")
        except CudaError as exc:  # the context cannot even be made current
            drv.failed_release(str(exc))
        self.pushed.closed = True  # the handles the program still holds are gone
        self.events.clear()
        self.streams.clear()
        self.internal.clear()
        self.markers.clear()
        self.tails.clear()
        if keep_context:
            logger.debug(
                "cuda:%d: work that may use its context is pending at close: the context is "
                "left to the exit",
                self.index,
            )
            return
        drv.released(
            cu.cuDevicePrimaryCtxRelease(self.index), self.index, "cuDevicePrimaryCtxRelease"
        )


class Devices:
    """The devices in use, created on first use, under the backend's one (reentrant) lock."""

    def __init__(self, drv: Driver, count: int) -> None:
        self.drv = drv
        self.count = count
        self.lock = threading.RLock()
        self.by_index: dict[int, Device] = {}
        # Set by close(): every handle is released then, so the finalizers of those the
        # program drops later return without taking the lock, which at the exit's end a daemon
        # thread (a watcher) may hold for good, frozen by the interpreter's finalization.
        self.closed = False

    def get(self, index: int) -> Device:
        """The device ``index``, retaining its primary context on first use."""
        dev = self.by_index.get(index)
        if dev is not None:
            return dev
        with self.lock:
            if self.closed:
                raise AiostreamError(CLOSED)
            dev = self.by_index.get(index)
            if dev is None:
                dev = self._open(index)
                self.by_index[index] = dev
            return dev

    def _open(self, index: int) -> Device:
        drv, cu = self.drv, self.drv.cu
        cu_dev = drv.check(cu.cuDeviceGet(index), index, "cuDeviceGet")
        ctx = drv.check(cu.cuDevicePrimaryCtxRetain(cu_dev), index, "cuDevicePrimaryCtxRetain")
        pushed = Pushed(drv, ctx, index)
        try:
            with pushed:
                err, least, greatest = cu.cuCtxGetStreamPriorityRange()
                if err != SUCCESS:
                    raise drv.error(err, index, "cuCtxGetStreamPriorityRange")
            attribute = cu.CUdevice_attribute(ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
            err, pools = cu.cuDeviceGetAttribute(attribute, cu_dev)
        except CudaError:
            cu.cuDevicePrimaryCtxRelease(cu_dev)
            raise
        priorities = (int(least), int(greatest))
        return Device(self.lock, pushed, priorities, err == SUCCESS and bool(pools))

    def __getitem__(self, index: int) -> Device:
        """A device already in use (its handles exist)."""
        return self.by_index[index]

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

    def close(self, free_memory: Callable[[Device], None], reap: Callable[[Device], None]) -> bool:
        """Release every handle but the memory the program still holds; False if already
        closed. Every use of the backend raises from then on.

        The memory of every device first: ``free_memory(dev)`` frees what the program dropped
        and its users' work has completed. Then every device is asked whether work is
        pending, all of them before any memory is reaped: a device seen idle has completed
        every marker recorded on it, so the frees waiting for those markers (``reap(dev)``,
        on a device itself idle) all go ahead. Memory still waiting, or still held, keeps
        its device's context, like pending work does: releasing the context would free it
        under that work, or under the program's views of it."""
        with self.lock:
            if self.closed:
                return False
            devices = list(self.by_index.values())
            for dev in devices:
                dev.watcher.close()
            for dev in devices:
                free_memory(dev)
            self.closed = True
            pending = {dev.index: dev.pending() for dev in devices}
            for dev in devices:
                if not pending[dev.index]:
                    reap(dev)
            for dev in devices:
                keep = pending[dev.index] or bool(dev.freeing) or bool(dev.memory)
                dev.release_all(keep_context=keep, work_pending=pending[dev.index])
            self.drv.report()
            return True
