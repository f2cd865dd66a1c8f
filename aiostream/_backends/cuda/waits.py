"""Waits on the CUDA backend: captures of streams and events as *markers* (internal events
with ``CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING``, so a thread blocked on one sleeps in
the driver instead of spinning, whatever flags the user's event has), and the ways a waiter
learns that one completed.

- A stream's capture records a marker on the stream itself.
- An event's capture makes a *watcher stream* wait for the user's event and records a marker
  after it. This also fixes the wait to the work the event captured when the wait began,
  whatever is recorded later. Captures of events recorded on one stream share a watcher stream
  (they complete in that stream's order anyway); watcher streams are pooled per device.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Hashable
from typing import Any

from ..._errors import CudaError
from .devices import Devices, Lane
from .driver import Driver
from .handles import Event, Stream

__all__ = ["Target", "Waits"]


class Target:
    """One wait: a marker event recorded after the captured work."""

    __slots__ = (
        "blockers",
        "index",
        "lane",
        "marker",
        "released",
        "seq",
        "token",
        "waits",
        "watcher",
    )

    def __init__(self, waits: Waits, index: int, lane: Hashable, seq: int, marker: Any):
        self.waits = waits
        self.index = index
        self.lane = lane
        self.seq = seq
        self.marker = marker
        self.watcher: Lane | None = None
        self.blockers = 0  # threads blocked on the marker; it is reused only after they return
        self.released = False
        self.token = 0  # the host-function callback, if one was asked for

    def done(self) -> bool:
        return self.waits.drv.done(self.marker, self.index, "cuEventQuery")

    def release(self) -> None:
        self.waits.release(self)


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


class Waits:
    """Captures, and what the waiter's strategies call: block, notify, release."""

    def __init__(self, drv: Driver, devices: Devices) -> None:
        self.drv = drv
        self.devices = devices
        self.hostfn = drv.cu.CUhostFn(ctypes.cast(_TRAMPOLINE, ctypes.c_void_p).value)

    def stream_capture(self, stream: Stream) -> Target:
        dev = self.devices[stream.index]
        if stream.default:
            dev.make_current()
        marker = dev.marker()
        try:
            self.drv.check(
                self.drv.cu.cuEventRecord(marker, stream.ptr), stream.index, "cuEventRecord"
            )
        except CudaError:
            dev.markers.append(marker)
            raise
        return Target(self, stream.index, ("stream", stream.id), next(stream.seq), marker)

    def event_capture(self, event: Event) -> Target:
        index = event.index
        dev = self.devices[index]
        cu = self.drv.cu
        with self.devices.lock:
            key: Hashable = ("watch", event.lane if event.lane is not None else object())
            lane = dev.lane(key)
            marker = dev.marker()
            target = Target(self, index, ("watch", lane.uid), next(lane.seq), marker)
            target.watcher = lane
            lane.pending += 1
            try:
                self.drv.check(
                    cu.cuStreamWaitEvent(lane.stream, event.ptr, 0), index, "cuStreamWaitEvent"
                )
                self.drv.check(cu.cuEventRecord(marker, lane.stream), index, "cuEventRecord")
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
                _callbacks.pop(target.token, None)
            self._settle(target)

    def _settle(self, target: Target) -> None:
        """Give back what a released wait holds, once no thread is blocked on it (lock held)."""
        if target.blockers or self.devices.closed:
            return
        dev = self.devices.by_index.get(target.index)
        if dev is None:
            return
        dev.markers.append(target.marker)
        lane = target.watcher
        if lane is not None:
            target.watcher = None
            lane.pending -= 1
            if lane.pending == 0:
                dev.end_lane(lane)

    def notify_done(self, target: Target, fn: Callable[[], None]) -> None:
        """Call ``fn`` on a driver thread when ``target`` completes (the ``callback`` strategy).

        Wraps ``cuLaunchHostFunc`` on a watcher stream that waits for the marker, so the host
        function never delays work on the user's streams.
        """
        cu = self.drv.cu
        index = target.index
        dev = self.devices[index]
        with self.devices.lock:
            if target.released or target.token:
                return
            if target.watcher is None:
                lane = dev.lane(("callback", target.lane))
                lane.pending += 1
                target.watcher = lane
                self.drv.check(
                    cu.cuStreamWaitEvent(lane.stream, target.marker, 0), index, "cuStreamWaitEvent"
                )
            token = target.token = next(_tokens)
            _callbacks[token] = fn
            try:
                self.drv.check(
                    cu.cuLaunchHostFunc(target.watcher.stream, self.hostfn, token),
                    index,
                    "cuLaunchHostFunc",
                )
            except CudaError:
                _callbacks.pop(token, None)
                raise

    def block(self, target: Target) -> None:
        """Block the calling thread (not the loop's) until ``target`` is done or failed.

        For the ``thread`` and ``hybrid`` strategies: ``cuEventSynchronize`` on a blocking-sync
        marker, which sleeps in the driver with the GIL released. Never raises; the waiter
        learns the outcome from ``target.done()``.
        """
        lock = self.devices.lock
        with lock:
            if target.released:
                return
            target.blockers += 1
        try:
            self.drv.cu.cuEventSynchronize(target.marker)
        finally:
            with lock:
                target.blockers -= 1
                if target.released:
                    self._settle(target)
