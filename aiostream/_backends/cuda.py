"""The CUDA backend: native driver calls through cuda-python (``cuda.bindings.driver``).

Each device runs on its primary context, retained on first use and released last, at
:meth:`CudaBackend.close` (registered with ``atexit``), after every event, stream, module and
buffer the backend still holds. Handles are released exactly once, from whichever thread drops
them; the driver calls that create things run with the device's context pushed, so the calling
thread's own current context is left as it was.

Waiting (see ``_waiting.py`` for the strategies) goes through *markers*: internal events created
with ``CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING``, so a thread blocked on one sleeps in
the driver instead of spinning, whatever flags the user's event has.

- ``stream.synchronize()`` records a marker on the stream itself.
- ``event.synchronize()`` makes a *watcher stream* wait for the user's event and records a
  marker after it. This also fixes the wait to the work the event captured when the wait began,
  whatever is recorded later. Captures of events recorded on one stream share a watcher stream
  (they complete in that stream's order anyway); watcher streams are pooled per device.

Every driver error goes through :meth:`CudaBackend._error`, the one place where a ``CUresult``
becomes an :class:`aiostream.CudaError`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from importlib import resources
from typing import Any, ClassVar

from .. import _hooks
from .._errors import AiostreamError, BackendUnavailableError, CudaError, NotReadyError

__all__ = ["CudaBackend"]

logger = logging.getLogger("aiostream")

_CU_STREAM_NON_BLOCKING = 0x1
_CU_EVENT_BLOCKING_SYNC = 0x1
_CU_EVENT_DISABLE_TIMING = 0x2
_CU_EVENT_INTERPROCESS = 0x4
_MARKER_FLAGS = _CU_EVENT_BLOCKING_SYNC | _CU_EVENT_DISABLE_TIMING
_SUCCESS = 0
_NOT_READY = 600
_INVALID_VALUE = 1
_NO_DEVICE = 100
_STUB_LIBRARY = 34
_INSUFFICIENT_DRIVER = 35
_SLEEP_KERNEL = b"aiostream_sleep"
_PTX_IMAGE: bytes | None = None
_lane_ids = itertools.count(1)


def _sleep_ptx() -> bytes:
    """The sleep kernel's PTX (kernels/sleep.cu, compiled by tools/build_ptx.py), NUL-ended."""
    global _PTX_IMAGE
    if _PTX_IMAGE is None:
        ptx = resources.files(__package__).joinpath("kernels/sleep.ptx").read_bytes()
        _PTX_IMAGE = ptx + b"\0"
    return _PTX_IMAGE


def load_driver() -> Any:
    """Import the bindings and initialise the driver, or say why CUDA cannot be used here."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailableError(
            "cuda",
            f"cuda-python is not installed ({exc}); run 'pip install cuda-python', or use a "
            "virtual device ('virtual:0')",
        ) from None
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as exc:  # cuda.pathfinder's DynamicLibNotFoundError: no libcuda.so.1
        raise BackendUnavailableError(
            "cuda",
            f"no NVIDIA driver library (libcuda.so.1) could be loaded ({exc}); install the "
            "NVIDIA driver, or use a virtual device ('virtual:0')",
        ) from None
    code = int(err)
    if code == _NO_DEVICE:
        raise BackendUnavailableError("cuda", "the NVIDIA driver found no CUDA device")
    if code == _STUB_LIBRARY:
        raise BackendUnavailableError(
            "cuda",
            "libcuda.so.1 is the CUDA toolkit's stub library, not a driver: put the real "
            "driver's library first on the library path",
        )
    if code == _INSUFFICIENT_DRIVER:
        raise BackendUnavailableError(
            "cuda",
            "the NVIDIA driver is older than the CUDA version cuda-python was built for; "
            "update the driver or install an older cuda-python",
        )
    if code != _SUCCESS:
        raise BackendUnavailableError("cuda", f"cuInit failed: {_describe(driver, code)}")
    err, count = driver.cuDeviceGetCount()
    if int(err) != _SUCCESS or not count:
        raise BackendUnavailableError("cuda", "the NVIDIA driver found no CUDA device")
    return driver


def _describe(driver: Any, code: int) -> str:
    """``NAME (code): message`` for a CUresult, as far as the driver can name it."""
    try:
        result = driver.CUresult(code)
    except ValueError:
        return f"CUresult {code}"
    err, name = driver.cuGetErrorName(result)
    err2, message = driver.cuGetErrorString(result)
    name_s = name.decode() if int(err) == _SUCCESS and name else result.name
    msg_s = message.decode() if int(err2) == _SUCCESS and message else ""
    return f"{name_s} ({code}): {msg_s}" if msg_s and msg_s != name_s else f"{name_s} ({code})"


# ---------------------------------------------------------------------- handles


class _Stream:
    __slots__ = ("__weakref__", "alive", "default", "id", "index", "owned", "ptr", "seq")

    def __init__(self, ptr: Any, index: int, *, owned: bool, default: bool = False) -> None:
        self.ptr = ptr
        self.index = index
        self.id = int(ptr)
        self.owned = owned
        self.default = default
        self.alive = True
        self.seq = itertools.count()


class _Event:
    __slots__ = ("__weakref__", "alive", "id", "index", "lane", "owned", "ptr")

    def __init__(self, ptr: Any, index: int, *, owned: bool) -> None:
        self.ptr = ptr
        self.index = index
        self.id = int(ptr)
        self.owned = owned
        self.alive = True
        #: the lane of captures: the stream it was last recorded on (None: not known)
        self.lane: Hashable | None = None


class _Memory:
    """Host (pinned or not) or device memory, and the markers of the copies that use it."""

    __slots__ = ("alive", "array", "device", "index", "nbytes", "ptr", "uses")

    def __init__(self, index: int, nbytes: int, ptr: int, *, device: bool, array: Any = None):
        self.index = index
        self.nbytes = nbytes
        self.ptr = ptr
        self.device = device
        self.array = array  # a bytearray for pageable host memory (ptr is then its address)
        self.alive = True
        self.uses: dict[int, Any] = {}  # stream id -> marker recorded after its last copy


class _Lane:
    """A watcher stream lent to one lane of captures while any of them is pending."""

    __slots__ = ("key", "pending", "seq", "stream", "uid")

    def __init__(self, key: Hashable, stream: Any) -> None:
        self.key = key
        self.uid = next(_lane_ids)
        self.stream = stream
        self.pending = 0
        self.seq = itertools.count()


class _Target:
    """One wait: a marker event recorded after the captured work."""

    __slots__ = (
        "backend",
        "blockers",
        "index",
        "lane",
        "marker",
        "released",
        "seq",
        "token",
        "watcher",
    )

    def __init__(self, backend: CudaBackend, index: int, lane: Hashable, seq: int, marker: Any):
        self.backend = backend
        self.index = index
        self.lane = lane
        self.seq = seq
        self.marker = marker
        self.watcher: _Lane | None = None
        self.blockers = 0  # threads blocked on the marker; it is reused only after they return
        self.released = False
        self.token = 0  # the host-function callback, if one was asked for

    def done(self) -> bool:
        return self.backend._event_done(self.marker, self.index, "cuEventQuery")

    def release(self) -> None:
        self.backend._release_target(self)


class _Device:
    """The per-device state: context, pools and the handles to release at close."""

    def __init__(self, index: int, ctx: Any, priorities: tuple[int, int]) -> None:
        self.index = index
        self.ctx = ctx
        self.priorities = priorities
        self.default = None  # type: _Stream | None
        self.streams: set[_Stream] = set()
        self.events: set[_Event] = set()
        self.memory: set[_Memory] = set()
        self.freeing: list[_Memory] = []  # host memory waiting for its copies before cuMemFreeHost
        self.markers: list[Any] = []
        self.idle_watchers: list[Any] = []
        self.draining_watchers: list[Any] = []  # released with work pending; reused once idle
        self.lanes: dict[Hashable, _Lane] = {}
        self.internal: list[Any] = []  # every marker and watcher stream ever made, for close
        self.free_stream: Any = None
        self.module: Any = None
        self.sleep: Any = None


# ---------------------------------------------------------------------- host-function callbacks

_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_callbacks: dict[int, Callable[[], None]] = {}
_tokens = itertools.count(1)


def _trampoline(token: int | None) -> None:
    """The one host function: runs on a driver thread, only for the ``callback`` strategy."""
    fn = _callbacks.pop(token or 0, None)
    if fn is not None:
        try:
            fn()
        except BaseException:  # nothing may propagate into the driver's thread
            pass


_TRAMPOLINE = _HOSTFN(_trampoline)  # kept alive for the life of the process


# ---------------------------------------------------------------------- the backend


class CudaBackend:
    """The CUDA driver behind ``cuda:N`` devices."""

    kind: ClassVar[str] = "cuda"
    #: the driver cannot say when work will complete: the waiter uses its strategies
    completion_times: ClassVar[bool] = False

    def __init__(self) -> None:
        self._driver = load_driver()
        d = self._driver
        err, count = d.cuDeviceGetCount()
        self._count = int(count)
        self._lock = threading.RLock()
        self._devices: dict[int, _Device] = {}
        self._closed = False
        self._hostfn = d.CUhostFn(ctypes.cast(_TRAMPOLINE, ctypes.c_void_p).value)
        atexit.register(self.close)
        _hooks.enable_nvtx()  # record_function's ranges reach Nsight Systems too

    # ------------------------------------------------------------------ errors, in one place

    def _error(self, err: Any, index: int | None, call: str) -> CudaError:
        code = int(err)
        detail = _describe(self._driver, code)
        name = detail.split(" ", 1)[0]
        where = f"cuda:{index}" if index is not None else "cuda"
        return CudaError(f"{call} failed on {where}: {detail}", device=where, code=code, name=name)

    def _check(self, result: tuple[Any, ...], index: int | None, call: str) -> Any:
        """The value of a driver call's result tuple, or raise its CudaError."""
        if result[0] != _SUCCESS:
            raise self._error(result[0], index, call)
        return result[1] if len(result) == 2 else None

    def _event_done(self, ptr: Any, index: int, call: str) -> bool:
        (err,) = self._driver.cuEventQuery(ptr)
        if err == _SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        raise self._error(err, index, call)

    # ------------------------------------------------------------------ devices and contexts

    def device_count(self) -> int:
        return self._count

    def device_name(self, index: int) -> str:
        dev = self._check(self._driver.cuDeviceGet(index), index, "cuDeviceGet")
        name = self._check(self._driver.cuDeviceGetName(256, dev), index, "cuDeviceGetName")
        return bytes(name).split(b"\0", 1)[0].decode(errors="replace").strip()

    def _device(self, index: int) -> _Device:
        dev = self._devices.get(index)
        if dev is not None:
            return dev
        with self._lock:
            if self._closed:
                raise AiostreamError("the CUDA backend was closed (the interpreter is exiting)")
            dev = self._devices.get(index)
            if dev is None:
                d = self._driver
                cu_dev = self._check(d.cuDeviceGet(index), index, "cuDeviceGet")
                ctx = self._check(
                    d.cuDevicePrimaryCtxRetain(cu_dev), index, "cuDevicePrimaryCtxRetain"
                )
                dev = _Device(index, ctx, (0, 0))
                try:
                    with self._pushed(dev):
                        err, least, greatest = d.cuCtxGetStreamPriorityRange()
                        if err != _SUCCESS:
                            raise self._error(err, index, "cuCtxGetStreamPriorityRange")
                except CudaError:
                    d.cuDevicePrimaryCtxRelease(cu_dev)
                    raise
                dev.priorities = (int(least), int(greatest))
                self._devices[index] = dev
            return dev

    @contextlib.contextmanager
    def _pushed(self, dev: _Device) -> Iterator[None]:
        """Make ``dev``'s context current for a block, restoring the thread's own afterwards."""
        self._check(self._driver.cuCtxPushCurrent(dev.ctx), dev.index, "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._driver.cuCtxPopCurrent()

    def _on_default(self, stream: _Stream) -> None:
        """Work on the default stream goes to the calling thread's current context: make it ours."""
        if stream.default:
            dev = self._devices[stream.index]
            self._check(self._driver.cuCtxSetCurrent(dev.ctx), stream.index, "cuCtxSetCurrent")

    # ------------------------------------------------------------------ streams

    def priority_range(self, index: int) -> tuple[int, int]:
        return self._device(index).priorities

    def stream_create(self, index: int, priority: int) -> _Stream:
        dev = self._device(index)
        with self._lock, self._pushed(dev):
            ptr = self._check(
                self._driver.cuStreamCreateWithPriority(_CU_STREAM_NON_BLOCKING, priority),
                index,
                "cuStreamCreateWithPriority",
            )
            stream = _Stream(ptr, index, owned=True)
            dev.streams.add(stream)
        return stream

    def stream_default(self, index: int) -> _Stream:
        dev = self._device(index)
        if dev.default is None:
            dev.default = _Stream(self._driver.CUstream(0), index, owned=False, default=True)
        return dev.default

    def stream_wrap(self, index: int, handle: int) -> tuple[_Stream, int]:
        """A stream made elsewhere (not owned: never destroyed here), and its priority."""
        dev = self._device(index)
        if handle == 0:
            return self.stream_default(index), 0
        ptr = self._driver.CUstream(handle)
        priority = self._check(self._driver.cuStreamGetPriority(ptr), index, "cuStreamGetPriority")
        return _Stream(ptr, dev.index, owned=False), int(priority)

    def stream_destroy(self, stream: _Stream) -> None:
        with self._lock:
            if stream.owned and self._retire(stream, "streams"):
                self._quiet(
                    self._driver.cuStreamDestroy(stream.ptr), stream.index, "cuStreamDestroy"
                )

    def stream_id(self, stream: _Stream) -> int:
        return stream.id

    def stream_query(self, stream: _Stream) -> bool:
        if stream.default:
            self._on_default(stream)
        (err,) = self._driver.cuStreamQuery(stream.ptr)
        if err == _SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        raise self._error(err, stream.index, "cuStreamQuery")

    def stream_wait_event(self, stream: _Stream, event: _Event) -> None:
        if stream.default:
            self._on_default(stream)
        self._check(
            self._driver.cuStreamWaitEvent(stream.ptr, event.ptr, 0),
            stream.index,
            "cuStreamWaitEvent",
        )

    def stream_capture(self, stream: _Stream) -> _Target:
        if stream.default:
            self._on_default(stream)
        dev = self._devices[stream.index]
        marker = self._marker(dev)
        try:
            self._check(
                self._driver.cuEventRecord(marker, stream.ptr), stream.index, "cuEventRecord"
            )
        except CudaError:
            dev.markers.append(marker)
            raise
        return _Target(self, stream.index, ("stream", stream.id), next(stream.seq), marker)

    # ------------------------------------------------------------------ events

    def event_create(
        self, index: int, *, timing: bool, blocking: bool, interprocess: bool
    ) -> _Event:
        flags = 0 if timing else _CU_EVENT_DISABLE_TIMING
        if blocking:
            flags |= _CU_EVENT_BLOCKING_SYNC
        if interprocess:
            flags |= _CU_EVENT_INTERPROCESS
        dev = self._device(index)
        with self._lock, self._pushed(dev):
            ptr = self._check(self._driver.cuEventCreate(flags), index, "cuEventCreate")
            event = _Event(ptr, index, owned=True)
            dev.events.add(event)
        return event

    def event_wrap(self, index: int, handle: int) -> _Event:
        """An event made elsewhere (not owned: never destroyed here)."""
        self._device(index)
        return _Event(self._driver.CUevent(handle), index, owned=False)

    def event_destroy(self, event: _Event) -> None:
        with self._lock:
            if event.owned and self._retire(event, "events"):
                self._quiet(self._driver.cuEventDestroy(event.ptr), event.index, "cuEventDestroy")

    def event_id(self, event: _Event) -> int:
        return event.id

    def event_record(self, event: _Event, stream: _Stream) -> None:
        if stream.default:
            self._on_default(stream)
        self._check(self._driver.cuEventRecord(event.ptr, stream.ptr), event.index, "cuEventRecord")
        event.lane = ("stream", stream.id)

    def event_query(self, event: _Event) -> bool:
        return self._event_done(event.ptr, event.index, "cuEventQuery")

    def event_capture(self, event: _Event) -> _Target:
        index = event.index
        dev = self._devices[index]
        d = self._driver
        with self._lock:
            key: Hashable = ("watch", event.lane if event.lane is not None else object())
            lane = self._lane(dev, key)
            marker = self._marker(dev)
            target = _Target(self, index, ("watch", lane.uid), next(lane.seq), marker)
            target.watcher = lane
            lane.pending += 1
            try:
                self._check(
                    d.cuStreamWaitEvent(lane.stream, event.ptr, 0), index, "cuStreamWaitEvent"
                )
                self._check(d.cuEventRecord(marker, lane.stream), index, "cuEventRecord")
            except CudaError:
                self._release_target(target)
                raise
        return target

    def event_elapsed_ms(self, start: _Event, end: _Event) -> float:
        err, ms = self._driver.cuEventElapsedTime(start.ptr, end.ptr)
        if err == _NOT_READY:
            raise NotReadyError(
                "elapsed_time() needs both events complete; await end_event.synchronize() first"
            )
        if err != _SUCCESS:
            raise self._error(err, start.index, "cuEventElapsedTime")
        return float(ms)

    def event_ipc_handle(self, event: _Event) -> bytes:
        handle = self._check(
            self._driver.cuIpcGetEventHandle(event.ptr), event.index, "cuIpcGetEventHandle"
        )
        return ctypes.string_at(handle.getPtr(), 64)

    def event_from_ipc_handle(self, index: int, data: bytes) -> _Event:
        d = self._driver
        handle = d.CUipcEventHandle()
        ctypes.memmove(handle.getPtr(), data, 64)
        dev = self._device(index)
        with self._lock, self._pushed(dev):
            err, ptr = d.cuIpcOpenEventHandle(handle)
            if err == _INVALID_VALUE:
                raise ValueError(
                    "the driver cannot open this event IPC handle (CUDA_ERROR_INVALID_VALUE): "
                    "pass the 64 bytes that Event.ipc_handle() returned in another process"
                ) from self._error(err, index, "cuIpcOpenEventHandle")
            if err != _SUCCESS:
                raise self._error(err, index, "cuIpcOpenEventHandle")
            event = _Event(ptr, index, owned=True)
            dev.events.add(event)
        return event

    # ------------------------------------------------------------------ markers and watchers

    def _marker(self, dev: _Device) -> Any:
        with self._lock:
            if dev.markers:
                return dev.markers.pop()
            with self._pushed(dev):
                marker = self._check(
                    self._driver.cuEventCreate(_MARKER_FLAGS), dev.index, "cuEventCreate"
                )
            dev.internal.append(("event", marker))
            return marker

    def _lane(self, dev: _Device, key: Hashable) -> _Lane:
        """The watcher stream of a lane of captures (called with the lock held)."""
        lane = dev.lanes.get(key)
        if lane is not None:
            return lane
        if not dev.idle_watchers and dev.draining_watchers:
            still: list[_Memory] = []
            for s in dev.draining_watchers:
                (err,) = self._driver.cuStreamQuery(s)
                (dev.idle_watchers if err == _SUCCESS else still).append(s)
            dev.draining_watchers = still
        if dev.idle_watchers:
            stream = dev.idle_watchers.pop()
        else:
            with self._pushed(dev):
                stream = self._check(
                    self._driver.cuStreamCreateWithPriority(
                        _CU_STREAM_NON_BLOCKING, dev.priorities[1]
                    ),
                    dev.index,
                    "cuStreamCreateWithPriority",
                )
            dev.internal.append(("stream", stream))
        lane = dev.lanes[key] = _Lane(key, stream)
        return lane

    def _release_target(self, target: _Target) -> None:
        with self._lock:
            if target.released:
                return
            target.released = True
            if target.token:
                _callbacks.pop(target.token, None)
            self._settle(target)

    def _settle(self, target: _Target) -> None:
        """Give back what a released wait holds, once no thread is blocked on it (lock held)."""
        if target.blockers or self._closed:
            return
        dev = self._devices.get(target.index)
        if dev is None:
            return
        dev.markers.append(target.marker)
        lane = target.watcher
        if lane is not None:
            target.watcher = None
            lane.pending -= 1
            if lane.pending == 0 and dev.lanes.get(lane.key) is lane:
                del dev.lanes[lane.key]
                (err,) = self._driver.cuStreamQuery(lane.stream)
                (dev.idle_watchers if err == _SUCCESS else dev.draining_watchers).append(
                    lane.stream
                )

    def notify_done(self, target: _Target, fn: Callable[[], None]) -> None:
        """Call ``fn`` on a driver thread when ``target`` completes (the ``callback`` strategy).

        Wraps ``cuLaunchHostFunc`` on a watcher stream that waits for the marker, so the host
        function never delays work on the user's streams.
        """
        d = self._driver
        index = target.index
        dev = self._devices[index]
        with self._lock:
            if target.released or target.token:
                return
            if target.watcher is None:
                lane = self._lane(dev, ("callback", target.lane))
                lane.pending += 1
                target.watcher = lane
                self._check(
                    d.cuStreamWaitEvent(lane.stream, target.marker, 0), index, "cuStreamWaitEvent"
                )
            token = target.token = next(_tokens)
            _callbacks[token] = fn
            try:
                self._check(
                    d.cuLaunchHostFunc(target.watcher.stream, self._hostfn, token),
                    index,
                    "cuLaunchHostFunc",
                )
            except CudaError:
                _callbacks.pop(token, None)
                raise

    # ------------------------------------------------------------------ device work

    def delay(self, stream: _Stream, seconds: float) -> None:
        dev = self._devices[stream.index]
        if dev.sleep is None:
            self._load_sleep(dev)
        if stream.default:
            self._on_default(stream)
        ns = round(seconds * 1e9)
        self._check(
            self._driver.cuLaunchKernel(
                dev.sleep, 1, 1, 1, 1, 1, 1, 0, stream.ptr, ((ns,), (ctypes.c_uint64,)), 0
            ),
            stream.index,
            "cuLaunchKernel",
        )

    def _load_sleep(self, dev: _Device) -> None:
        d = self._driver
        with self._lock, self._pushed(dev):
            if dev.sleep is not None:
                return
            module = self._check(d.cuModuleLoadData(_sleep_ptx()), dev.index, "cuModuleLoadData")
            dev.module = module
            dev.sleep = self._check(
                d.cuModuleGetFunction(module, _SLEEP_KERNEL), dev.index, "cuModuleGetFunction"
            )

    # ------------------------------------------------------------------ memory and copies

    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> _Memory:
        dev = self._device(index)
        if not pinned:  # pageable: the driver stages copies from it before the call returns
            array = bytearray(nbytes)
            ptr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(array)) if nbytes else 0
            return _Memory(index, nbytes, ptr, device=False, array=array)
        with self._lock, self._pushed(dev):
            self._reap(dev)
            ptr = self._check(
                self._driver.cuMemHostAlloc(max(nbytes, 1), 0), index, "cuMemHostAlloc"
            )
            mem = _Memory(index, nbytes, int(ptr), device=False)
            dev.memory.add(mem)
        return mem

    def host_view(self, host: _Memory) -> memoryview:
        if host.array is not None:
            return memoryview(host.array)
        if not host.nbytes:
            return memoryview(bytearray())
        return memoryview((ctypes.c_char * host.nbytes).from_address(host.ptr)).cast("B")

    def host_access(self, host: _Memory) -> None:
        """Nothing to check: the driver has no race detector (the virtual backend does)."""

    def host_free(self, host: _Memory) -> None:
        if host.array is not None:
            host.alive = False
            return
        with self._lock:
            dev = self._retire(host, "memory")
            if dev is not None:
                dev.freeing.append(host)  # freed by _reap once its copies have completed
                self._reap(dev)

    def _reap(self, dev: _Device) -> None:
        """Free host memory whose copies have completed (lock held)."""
        still = []
        for mem in dev.freeing:
            if all(self._quiet_done(m) for m in mem.uses.values()):
                self._drop_uses(dev, mem)
                self._quiet(self._driver.cuMemFreeHost(mem.ptr), dev.index, "cuMemFreeHost")
            else:
                still.append(mem)
        dev.freeing = still

    def _quiet_done(self, marker: Any) -> bool:
        (err,) = self._driver.cuEventQuery(marker)
        return bool(err != _NOT_READY)  # complete, or failed: either way the copy is over

    def _drop_uses(self, dev: _Device, mem: _Memory) -> None:
        dev.markers.extend(mem.uses.values())
        mem.uses.clear()

    def device_alloc(self, index: int, nbytes: int, stream: _Stream | None) -> _Memory:
        dev = self._device(index)
        s = stream if stream is not None else self.stream_default(index)
        if s.default:
            self._on_default(s)
        with self._lock, self._pushed(dev):
            ptr = self._check(
                self._driver.cuMemAllocAsync(max(nbytes, 1), s.ptr), index, "cuMemAllocAsync"
            )
            mem = _Memory(index, nbytes, int(ptr), device=True)
            dev.memory.add(mem)
        self._used(mem, s)
        return mem

    def device_free(self, mem: _Memory) -> None:
        """Free on an internal stream, after every copy that used the memory (on the device)."""
        d = self._driver
        with self._lock:
            dev = self._retire(mem, "memory")
            if dev is None:
                return
            if dev.free_stream is None:
                with self._pushed(dev):
                    dev.free_stream = self._check(
                        d.cuStreamCreateWithPriority(_CU_STREAM_NON_BLOCKING, dev.priorities[0]),
                        dev.index,
                        "cuStreamCreateWithPriority",
                    )
                dev.internal.append(("stream", dev.free_stream))
            for marker in mem.uses.values():
                self._quiet(
                    d.cuStreamWaitEvent(dev.free_stream, marker, 0), dev.index, "cuStreamWaitEvent"
                )
            self._drop_uses(dev, mem)
            self._quiet(
                d.cuMemFreeAsync(d.CUdeviceptr(mem.ptr), dev.free_stream),
                dev.index,
                "cuMemFreeAsync",
            )

    def device_ptr(self, mem: _Memory) -> int:
        return mem.ptr

    def copy(self, stream: _Stream, dst: _Memory, src: _Memory, nbytes: int, kind: str) -> None:
        d = self._driver
        if stream.default:
            self._on_default(stream)
        if kind == "h2d":
            result = d.cuMemcpyHtoDAsync(d.CUdeviceptr(dst.ptr), src.ptr, nbytes, stream.ptr)
            call = "cuMemcpyHtoDAsync"
        elif kind == "d2h":
            result = d.cuMemcpyDtoHAsync(dst.ptr, d.CUdeviceptr(src.ptr), nbytes, stream.ptr)
            call = "cuMemcpyDtoHAsync"
        elif kind == "d2d":
            result = d.cuMemcpyDtoDAsync(
                d.CUdeviceptr(dst.ptr), d.CUdeviceptr(src.ptr), nbytes, stream.ptr
            )
            call = "cuMemcpyDtoDAsync"
        else:
            raise ValueError(f"copy kind must be 'h2d', 'd2h' or 'd2d', got {kind!r}")
        self._check(result, stream.index, call)
        self._used(dst, stream)
        self._used(src, stream)

    def _used(self, mem: _Memory, stream: _Stream) -> None:
        """Remember the point on ``stream`` after which ``mem`` is no longer in use there."""
        if mem.array is not None:
            return  # pageable memory: the driver copies it before the call returns
        with self._lock:
            marker = mem.uses.get(stream.id)
            if marker is None:
                marker = mem.uses[stream.id] = self._marker(self._devices[mem.index])
        self._check(self._driver.cuEventRecord(marker, stream.ptr), stream.index, "cuEventRecord")

    # ------------------------------------------------------------------ waiting

    def wake_hint(self, index: int) -> float | None:
        return None  # the driver gives no completion times: see completion_times

    def subscribe(self, index: int, callback: Callable[[], None]) -> Callable[[], None]:
        return _nothing

    def block(self, target: _Target) -> None:
        """Block the calling thread (not the loop's) until ``target`` is done or failed.

        For the ``thread`` and ``hybrid`` strategies: ``cuEventSynchronize`` on a blocking-sync
        marker, which sleeps in the driver with the GIL released. Never raises; the waiter
        learns the outcome from ``target.done()``.
        """
        with self._lock:
            if target.released:
                return
            target.blockers += 1
        try:
            self._driver.cuEventSynchronize(target.marker)
        finally:
            with self._lock:
                target.blockers -= 1
                if target.released:
                    self._settle(target)

    def wait_blocking(self, target: _Target) -> None:
        self.block(target)
        target.done()  # raises the device's error, if the work failed

    # ------------------------------------------------------------------ lifetime

    def _retire(self, handle: _Stream | _Event | _Memory, owner: str) -> _Device | None:
        """Mark ``handle`` released (lock held): its device, if the caller must release it.

        None if it was released before, or if close() released it with its context.
        """
        if not handle.alive:
            return None
        handle.alive = False
        dev = self._devices.get(handle.index)
        if dev is None or self._closed:
            return None
        getattr(dev, owner).discard(handle)
        return dev

    def _quiet(self, result: tuple[Any, ...], index: int, call: str) -> None:
        """Release calls never raise (they run in finalizers): log what went wrong."""
        if result[0] != _SUCCESS:
            logger.warning("%s", self._error(result[0], index, call))

    def close(self) -> None:
        """Release every handle, then the primary contexts (idempotent; runs at exit)."""
        d = self._driver
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for dev in self._devices.values():
                for mem in list(dev.freeing):
                    if all(self._quiet_done(m) for m in mem.uses.values()):
                        d.cuMemFreeHost(mem.ptr)
                dev.freeing.clear()
                for event in dev.events:
                    event.alive = False
                    d.cuEventDestroy(event.ptr)
                for stream in dev.streams:
                    stream.alive = False
                    d.cuStreamDestroy(stream.ptr)
                for what, handle in dev.internal:
                    (d.cuEventDestroy if what == "event" else d.cuStreamDestroy)(handle)
                if dev.module is not None:
                    d.cuModuleUnload(dev.module)
                # Memory still in use is left to the context's release (or the process's exit).
                dev.events.clear()
                dev.streams.clear()
                dev.internal.clear()
                d.cuDevicePrimaryCtxRelease(dev.index)
        atexit.unregister(self.close)


def _nothing() -> None:
    pass
