"""The backend protocol: what a device runtime gives aiostream.

Backends deal in opaque handles and plain values; they know nothing of user objects, event loops
or anyio. The user objects in ``stream.py`` and ``event.py`` hold a backend and a handle and
never branch on the backend's kind; ``_waiting.py`` turns :class:`WaitTarget` completion into
task wake-ups.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, ClassVar, Protocol

__all__ = ["Backend", "WaitTarget", "WatchedTarget"]

Handle = Any


class WaitTarget(Protocol):
    """The work captured by one wait: fixed when the wait starts, whatever is recorded later.

    Targets that share a ``lane`` complete in ``seq`` order (work on one stream runs in
    submission order), so a waiter needs to check only the lowest pending ``seq`` of each lane.
    """

    lane: Hashable
    seq: int

    def done(self) -> bool:
        """Return whether the captured work completed; raise ``DeviceError`` if it failed."""

    def release(self) -> None:
        """Forget the wait (idempotent); the work itself goes on."""


class WatchedTarget(WaitTarget, Protocol):
    """A target of a backend with ``completion_times``: it tells when its work completes."""

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from any thread, when the work completes or fails or the
        backend closes (at once if it already has); :meth:`release` cancels it. The waiter
        thereby finishes just the waits that completed, never visiting the pending ones."""


class Backend(Protocol):
    """A device runtime: the ``virtual`` simulator or the CUDA driver."""

    kind: ClassVar[str]
    #: whether :meth:`wake_hint` gives exact completion times and targets are
    #: :class:`WatchedTarget` (virtual); if not (CUDA), the waiter watches lane heads with a
    #: strategy and uses :meth:`block` and :meth:`notify_done`
    completion_times: ClassVar[bool]

    def device_count(self) -> int: ...
    def device_name(self, index: int) -> str:
        """A name for ``python -m aiostream info``: the GPU's, or what the device is."""

    def close(self) -> None: ...

    # streams
    def priority_range(self, index: int) -> tuple[int, int]:
        """(lowest, highest) priority; lower numbers are higher priorities, as in CUDA."""

    def stream_create(self, index: int, priority: int) -> Handle: ...
    def stream_default(self, index: int) -> Handle: ...
    def stream_wrap(self, index: int, handle: int) -> tuple[Handle, int]:
        """A stream made elsewhere, not owned, and its priority (CUDA only)."""

    def stream_destroy(self, stream: Handle) -> None: ...
    def stream_id(self, stream: Handle) -> int: ...
    def stream_query(self, stream: Handle) -> bool: ...
    def stream_wait_event(self, stream: Handle, event: Handle) -> None: ...
    def stream_capture(self, stream: Handle) -> WaitTarget: ...

    # events
    def event_create(
        self, index: int, *, timing: bool, blocking: bool, interprocess: bool
    ) -> Handle: ...
    def event_wrap(self, index: int, handle: int) -> Handle:
        """An event made elsewhere, not owned (CUDA only)."""

    def event_destroy(self, event: Handle) -> None: ...
    def event_id(self, event: Handle) -> int: ...
    def event_record(self, event: Handle, stream: Handle) -> None: ...
    def event_query(self, event: Handle) -> bool: ...
    def event_capture(self, event: Handle) -> WaitTarget: ...
    def event_elapsed_ms(self, start: Handle, end: Handle) -> float: ...
    def event_ipc_handle(self, event: Handle) -> bytes: ...
    def event_from_ipc_handle(self, index: int, data: bytes) -> Handle: ...

    # device work
    def delay(self, stream: Handle, seconds: float) -> None: ...

    # memory and copies; a handle freed while a copy uses it is released when the copy is done
    def host_alloc(self, index: int, nbytes: int, *, pinned: bool) -> Handle: ...
    def host_view(self, host: Handle) -> memoryview:
        """The host memory, writable, for a zero-copy numpy view."""

    def host_access(self, host: Handle) -> None:
        """The host is about to read or write ``host`` (the virtual backend checks for races)."""

    def host_free(self, host: Handle) -> None: ...
    def device_alloc(self, index: int, nbytes: int, stream: Handle | None) -> Handle: ...
    def device_free(self, mem: Handle) -> None: ...
    def device_ptr(self, mem: Handle) -> int:
        """The device address (for ``__cuda_array_interface__``); raise where there is none."""

    def copy(self, stream: Handle, dst: Handle, src: Handle, nbytes: int, kind: str) -> None:
        """Enqueue a copy of ``nbytes`` on ``stream``; ``kind`` is ``h2d``, ``d2h`` or ``d2d``."""

    # waiting
    def wake_hint(self, index: int) -> float | None:
        """Seconds after which pending work on device ``index`` may have made progress.

        ``None`` means: nothing will change until a listener given to :meth:`subscribe` is
        called (a manual clock advanced, an engine released, the backend closed, or work
        submitted that ends before the time last hinted).
        """

    def subscribe(self, index: int, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from any thread) when progress happens outside the clock's flow.

        Returns the function that unsubscribes.
        """

    def wait_blocking(self, target: Any) -> None:
        """Block the calling thread until ``target`` is done (raising its error)."""

    def block(self, target: Any) -> None:
        """Block the calling thread until ``target`` is done or failed; never raise.

        Safe to run while the target is released from another thread: what the target holds
        is given back when both are over.
        """

    def notify_done(self, target: Any, fn: Callable[[], None]) -> None:
        """Call ``fn`` from a driver thread when ``target`` completes (at most once)."""
