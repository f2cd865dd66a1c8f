"""Time for the virtual backend: integer nanoseconds, the manual clock, and listener lists."""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Callable

from ..._check import MAX_SECONDS

__all__ = ["Listeners", "VirtualClock", "resolve_clock", "seconds_to_ns"]


def seconds_to_ns(value: object, name: str, *, allow_negative: bool = False) -> int:
    """Validate a duration in seconds and return it in integer nanoseconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds (int or float), got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0 and not allow_negative:
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    if abs(value) > MAX_SECONDS:
        raise ValueError(
            f"{name} must be at most {MAX_SECONDS:g} seconds (292 years), got {value!r}"
        )
    return round(value * 1_000_000_000)


class Listeners:
    """Callbacks to call, from any thread, when something happens; each can unsubscribe."""

    __slots__ = ("_callbacks", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def add(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Register ``callback``; return the function that removes it (idempotent)."""
        with self._lock:
            self._callbacks.append(callback)

        def remove() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return remove

    def __call__(self) -> None:
        """Call every callback, outside the lock (a callback may add or remove others)."""
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()


class VirtualClock:
    """A manual clock for the virtual backend: device time moves only when advanced.

    Waits on a device driven by this clock resume when an :meth:`advance` passes the completion
    of their work. It may be advanced from any thread.

    Example:
        >>> clock = VirtualClock()
        >>> clock.advance(0.5)
        >>> clock.now()
        0.5
    """

    def __init__(self, start: float = 0.0) -> None:
        self._ns = seconds_to_ns(start, "start", allow_negative=True)
        self._lock = threading.Lock()
        self._advanced = Listeners()

    def now(self) -> float:
        """The clock's time in seconds."""
        return self._ns / 1e9

    def now_ns(self) -> int:
        """The clock's time in integer nanoseconds."""
        return self._ns

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (>= 0) and wake the waits that came due."""
        ns = seconds_to_ns(seconds, "seconds")
        with self._lock:
            self._ns += ns
        self._advanced()

    def __repr__(self) -> str:
        return f"VirtualClock(now={self.now()!r})"


def _reading_ns(value: object) -> int:
    """A callable clock's reading other than a plain float in range: checked, in ns."""
    if inspect.iscoroutine(value):
        value.close()  # never awaited, and said so here rather than in a warning
    try:
        return seconds_to_ns(value, "clock", allow_negative=True)
    except TypeError:
        raise TypeError(
            f"the virtual device's clock returned {value!r}, not a number of seconds (int or "
            "float); give reset(clock=...) a callable that returns seconds"
        ) from None
    except ValueError:
        raise ValueError(
            f"the virtual device's clock returned {value!r} seconds; a clock reads finite "
            f"seconds, at most {MAX_SECONDS:g} from zero"
        ) from None


def listen(clock: VirtualClock, callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` whenever ``clock`` is advanced; return the function that stops it."""
    return clock._advanced.add(callback)  # noqa: SLF001 (VirtualClock is this module's)


def resolve_clock(clock: object) -> tuple[Callable[[], int], VirtualClock | None]:
    """Return (read the clock in nanoseconds, the manual clock or None) for a ``clock`` option."""
    if clock is None:
        return time.monotonic_ns, None
    if isinstance(clock, VirtualClock):
        return clock.now_ns, clock
    if inspect.iscoroutinefunction(clock):
        raise TypeError(
            f"clock must return seconds when called; {clock!r} is an async function (its "
            "call returns a coroutine): give a plain function"
        )
    if callable(clock):
        read: Callable[[], float] = clock

        def now_ns() -> int:
            value = read()
            # nan fails this test
            if type(value) is float and (
                # a fast path: the slow one gives the same result
                -MAX_SECONDS <= value <= MAX_SECONDS  # pragma: no mutate (equivalent: as above)
            ):
                return round(value * 1_000_000_000)
            return _reading_ns(value)

        return now_ns, None
    raise TypeError(
        "clock must be None (the monotonic clock), a VirtualClock, or a callable returning "
        f"seconds, got {clock!r}"
    )
