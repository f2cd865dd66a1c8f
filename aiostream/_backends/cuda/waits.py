"""Waits on the CUDA backend: captures of streams and events as *markers* (internal events
with ``CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING``, so a thread blocked on one sleeps in
the driver instead of spinning, whatever flags the user's event has), and the ways a waiter
learns that one completed.

- A stream's capture records a marker on the stream itself.
- An event's capture makes a *watcher stream* wait for the user's event and records a marker
  after it. This also fixes the wait to the work the event captured when the wait began,
  whatever is recorded later. Captures of events recorded on one stream share a watcher stream
  (they complete in that stream's order anyway); watcher streams are pooled per device.
- The ``callback`` strategy learns of completions from host functions, which must never run
  Python: the host function is libc's ``sem_post`` on a semaphore of the device (in memory that
  is never freed, so a host function that runs during or after interpreter exit is harmless),
  and a daemon thread of the device (:class:`Notifier`) waits on that semaphore with the GIL
  released, then tells the waiters whose markers completed.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from ..._errors import CudaError
from .devices import Device, Devices, Lane
from .driver import SUCCESS, Driver
from .handles import Event, Stream

__all__ = ["Notifier", "Target", "Waits", "semaphores"]

logger = logging.getLogger("aiostream")


class Target:
    """One wait: a marker event recorded after the captured work."""

    __slots__ = (
        "blockers",
        "dev",
        "index",
        "lane",
        "marker",
        "released",
        "seq",
        "token",
        "waits",
        "watcher",
    )

    def __init__(self, waits: Waits, dev: Device, lane: Hashable, seq: int, marker: Any):
        self.waits = waits
        self.dev = dev
        self.index = dev.index
        self.lane = lane
        self.seq = seq
        self.marker = marker
        self.watcher: Lane | None = None
        self.blockers = 0  # threads blocked on the marker; it is reused only after they return
        self.released = False
        self.token = 0  # the host-function callback, if one was asked for

    def done(self) -> bool:
        """Whether the captured work completed (``cuEventQuery``); raise if it failed."""
        dev = self.dev
        with dev.pushed:
            (err,) = dev.drv.cu.cuEventQuery(self.marker)
        return dev.drv.ready(err, self.index, "cuEventQuery")

    def release(self) -> None:
        self.waits.release(self)


# ---------------------------------------------------------------------- C host functions


class _Semaphores:
    """libc's POSIX semaphores through ctypes: ``sem_post`` is the host function."""

    SIZE = 64  # bytes for one sem_t (32 on glibc x86-64 and aarch64), with room to spare

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.libc = libc
        for name in ("sem_init", "sem_post", "sem_wait", "sem_timedwait"):
            getattr(libc, name).restype = ctypes.c_int
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        self.post_address: int = ctypes.cast(libc.sem_post, ctypes.c_void_p).value or 0

    def new(self) -> int:
        """A semaphore at 0, in memory that is never freed (a late host function may post
        it while the interpreter exits)."""
        sem = self.libc.malloc(self.SIZE)
        if not sem or self.libc.sem_init(ctypes.c_void_p(sem), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        return int(sem)

    def post(self, sem: int) -> None:
        self.libc.sem_post(ctypes.c_void_p(sem))

    def wait(self, sem: int, timeout: float | None) -> None:
        """Wait (GIL released) until posted, or ``timeout`` seconds."""
        if timeout is None:
            self.libc.sem_wait(ctypes.c_void_p(sem))
            return
        deadline = time.time() + timeout
        ts = (ctypes.c_long * 2)(int(deadline), int((deadline % 1) * 1e9))
        self.libc.sem_timedwait(ctypes.c_void_p(sem), ts)


def _load_semaphores() -> _Semaphores | None:
    try:
        return _Semaphores()
    except (OSError, AttributeError):  # no POSIX libc (Windows): callback waits use a thread
        return None


semaphores = _load_semaphores()


class Notifier:
    """A device's daemon thread that wakes on the device's semaphore (posted by the host
    functions, or by :meth:`close`) and calls back the waits whose markers completed.

    While callbacks are registered it also wakes every ``SAFETY_S``: host functions never run
    once the device has failed, and a failed marker counts as over.
    """

    SAFETY_S = 0.05

    def __init__(self, dev: Device, sems: _Semaphores) -> None:
        self.dev = dev
        self.sems = sems
        self.sem = sems.new()
        self.callbacks: dict[int, tuple[Target, Callable[[], None]]] = {}
        self.closed = False
        self.thread = threading.Thread(
            target=self._run, name=f"aiostream cuda:{dev.index} notifier", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        while not self.closed:
            self.sems.wait(self.sem, self.SAFETY_S if self.callbacks else None)
            with self.dev.lock:
                ready = [
                    (token, fn)
                    for token, (target, fn) in self.callbacks.items()
                    if target.released or self.dev.over(target.marker)
                ]
                for token, _ in ready:
                    del self.callbacks[token]
            for _, fn in ready:
                try:
                    fn()
                except Exception:  # a callback must not end the thread of every other one
                    logger.exception("aiostream: a wait's completion callback failed")

    def close(self) -> None:
        self.closed = True
        self.sems.post(self.sem)


_LAUNCH_HOST_FUNC = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)


def _driver_launch_host_func(drv: Driver) -> Callable[[int, int, int], int] | None:
    """The driver's own ``cuLaunchHostFunc``, called through ctypes.

    Not cuda-python's ``driver.cuLaunchHostFunc``: that one launches a wrapper of its own,
    which takes the GIL (``PyGILState_Ensure``) on the driver's thread before it calls the
    function given, even a C function: the deadlock this module exists to avoid, and a crash
    when a host function runs after the interpreter has finalized.
    """
    try:
        err, address, _ = drv.cu.cuGetProcAddress(b"cuLaunchHostFunc", 10000, 0)
    except (RuntimeError, ValueError, TypeError):  # a driver without cuGetProcAddress
        return None
    if err != SUCCESS or not address:
        return None
    launch: Callable[[int, int, int], int] = _LAUNCH_HOST_FUNC(int(address))
    return launch


# ---------------------------------------------------------------------- the waits


class Waits:
    """Captures, and what the waiter's strategies call: block, notify, release."""

    def __init__(self, drv: Driver, devices: Devices) -> None:
        self.drv = drv
        self.devices = devices
        self.notifiers: dict[int, Notifier] = {}
        self.tokens = itertools.count(1)
        self.launch_host_func = _driver_launch_host_func(drv) if semaphores is not None else None

    def stream_capture(self, stream: Stream) -> Target:
        dev = self.devices[stream.index]
        marker = dev.record_marker(stream)
        return Target(self, dev, ("stream", stream.key), next(stream.seq), marker)

    def event_capture(self, event: Event) -> Target:
        dev = self.devices[event.index]
        cu = self.drv.cu
        with self.devices.lock:
            key: Hashable = ("watch", event.lane if event.lane is not None else object())
            lane = dev.lane(key)
            marker = dev.marker()
            target = Target(self, dev, ("watch", lane.uid), next(lane.seq), marker)
            target.watcher = lane
            lane.pending += 1
            try:
                with dev.pushed:
                    self.drv.check(
                        cu.cuStreamWaitEvent(lane.stream, event.ptr, 0),
                        dev.index,
                        "cuStreamWaitEvent",
                    )
                    self.drv.check(
                        cu.cuEventRecord(marker, lane.stream), dev.index, "cuEventRecord"
                    )
            except CudaError:
                self.release(target)
                raise
        return target

    def release(self, target: Target) -> None:
        with self.devices.lock:
            if target.released:
                return
            target.released = True
            if target.token:
                notifier = self.notifiers.get(target.index)
                if notifier is not None:
                    notifier.callbacks.pop(target.token, None)
            self._settle(target)

    def _settle(self, target: Target) -> None:
        """Give back what a released wait holds, once no thread is blocked on it (lock held)."""
        if target.blockers or self.devices.closed:
            return
        dev = target.dev
        dev.markers.append(target.marker)
        lane = target.watcher
        if lane is not None:
            target.watcher = None
            lane.pending -= 1
            if lane.pending == 0:
                dev.end_lane(lane)

    def notify_done(self, target: Target, fn: Callable[[], None]) -> None:
        """Call ``fn`` from the device's notifier thread when ``target`` completes (the
        ``callback`` strategy).

        Wraps ``cuLaunchHostFunc`` of ``sem_post`` on a watcher stream that waits for the
        marker, so the host function never delays work on the user's streams. Without a
        POSIX libc, a daemon thread blocks on the marker instead.
        """
        if self.launch_host_func is None or semaphores is None:
            threading.Thread(target=self._block_then, args=(target, fn), daemon=True).start()
            return
        cu = self.drv.cu
        dev = target.dev
        with self.devices.lock:
            if target.released or target.token or self.devices.closed:
                return
            notifier = self.notifiers.get(dev.index)
            if notifier is None:
                notifier = self.notifiers[dev.index] = Notifier(dev, semaphores)
            with dev.pushed:
                if target.watcher is None:
                    lane = dev.lane(("callback", target.lane))
                    lane.pending += 1
                    target.watcher = lane
                    self.drv.check(
                        cu.cuStreamWaitEvent(lane.stream, target.marker, 0),
                        dev.index,
                        "cuStreamWaitEvent",
                    )
                token = target.token = next(self.tokens)
                notifier.callbacks[token] = (target, fn)
                try:
                    err = self.launch_host_func(
                        int(target.watcher.stream), semaphores.post_address, notifier.sem
                    )
                    self.drv.check((err,), dev.index, "cuLaunchHostFunc")
                except CudaError:
                    notifier.callbacks.pop(token, None)
                    raise

    def _block_then(self, target: Target, fn: Callable[[], None]) -> None:
        self.block(target)
        fn()

    def block(self, target: Target) -> None:
        """Block the calling thread (not the loop's) until ``target`` is done or failed.

        For the ``thread`` and ``hybrid`` strategies: ``cuEventSynchronize`` on a blocking-sync
        marker, which sleeps in the driver with the GIL released. Never raises; the waiter
        learns the outcome from ``target.done()``.
        """
        lock = self.devices.lock
        dev = target.dev
        key = int(target.marker)
        with lock:
            if target.released or self.devices.closed:
                return
            target.blockers += 1
            dev.blocked[key] = dev.blocked.get(key, 0) + 1
        try:
            with dev.pushed:
                self.drv.cu.cuEventSynchronize(target.marker)
        except CudaError:
            pass  # the context is gone: the waiter's check says so
        finally:
            with lock:
                target.blockers -= 1
                left = dev.blocked[key] - 1
                if left:
                    dev.blocked[key] = left
                else:
                    del dev.blocked[key]
                if target.released:
                    self._settle(target)

    def close(self) -> None:
        """Stop the notifier threads (lock held, at close)."""
        for notifier in self.notifiers.values():
            notifier.close()
        self.notifiers.clear()
