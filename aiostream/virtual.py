"""The virtual backend's controls: a deterministic simulated device for tests and demos.

``virtual:N`` devices need no GPU. Their work takes simulated time on engines (``compute``,
``h2d``, ``d2h``), read from one clock: the monotonic clock by default (work takes real time), a
manual :class:`VirtualClock` (time moves only when advanced), or any callable returning seconds,
such as a fake-time loop's clock (work then takes virtual time and tests run instantly).

Example:
    >>> import aiostream as ais
    >>> clock = ais.virtual.VirtualClock()
    >>> ais.virtual.reset(clock=clock)
    >>> s = ais.Stream("virtual:0")
    >>> ais.virtual.submit(s, 0.5, name="kernel")
    >>> s.query()
    False
    >>> clock.advance(0.5)
    >>> s.query()
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import TracebackType
from typing import Any

from . import _backends, _check, _diagnostics, _objects
from ._backends.virtual import (
    DEFAULT_BANDWIDTH,
    DEFAULT_D2D_BANDWIDTH,
    DEFAULT_LATENCY,
    DEFAULT_MEMORY,
    ENGINES,
    POISON,
    PRIORITY_RANGE,
    PROFILE_VARIABLE,
    DeviceProfile,
    OpRecord,
    Race,
    VirtualBackend,
    VirtualClock,
    VirtualOptions,
    VirtualStats,
    seconds_to_ns,
)
from .device import Device
from .device import device as _resolve_device
from .stream import Stream

__all__ = [
    "ENGINES",
    "PROFILE_VARIABLE",
    "DeviceProfile",
    "POISON",
    "PRIORITY_RANGE",
    "OpRecord",
    "Race",
    "VirtualClock",
    "VirtualOptions",
    "Stall",
    "Transfer",
    "VirtualStats",
    "assert_no_races",
    "fail_next",
    "now",
    "races",
    "reset",
    "slow_next",
    "stall",
    "stats",
    "submit",
    "timeline",
]


def _backend() -> VirtualBackend:
    backend = _backends.get("virtual")
    assert isinstance(backend, VirtualBackend)
    return backend


def _count(value: object, name: str) -> int:
    return _check.integer(value, name, minimum=1)


def reset(
    *,
    devices: int = 1,
    clock: VirtualClock | Callable[[], float] | None = None,
    compute_slots: int = 1,
    h2d_slots: int = 1,
    d2h_slots: int = 1,
    bandwidth: float = DEFAULT_BANDWIDTH,
    latency: float = DEFAULT_LATENCY,
    d2d_bandwidth: float = DEFAULT_D2D_BANDWIDTH,
    memory: int = DEFAULT_MEMORY,
    profile: DeviceProfile | str | os.PathLike[str] | None = None,
) -> None:
    """Replace the virtual backend with a fresh one.

    Streams and events made before the reset raise ``StaleHandleError`` when used, and waits
    still pending on them wake up with that error: nothing hangs.

    Inside a test that uses the pytest plugin's ``virtual_device`` (or ``virtual_time``)
    fixture, the new backend keeps the fixture's clock unless ``clock`` is given (under
    ``virtual_time`` it cannot be: that raises ``ValueError``), and what the replaced backend
    leaked still fails the test at teardown.

    Args:
        devices: how many devices (``virtual:0`` .. ``virtual:{devices-1}``).
        clock: None for the monotonic clock, a :class:`VirtualClock`, or a callable returning
            seconds. All devices share it: one timeline, never mixed clocks.
        compute_slots: operations the compute engine of each device runs at once.
        h2d_slots: likewise for the host-to-device copy engine.
        d2h_slots: likewise for the device-to-host copy engine.
        bandwidth: bytes per second of host-device copies (default 25e9, near PCIe 4.0 x16).
        latency: seconds every copy adds (default 10e-6): a copy takes
            ``latency + nbytes / bandwidth``.
        d2d_bandwidth: bytes per second of device-to-device copies, which run on the compute
            engine (default 1e12).
        memory: bytes of memory per device (default 16 GiB); an allocation past what is free
            raises ``DeviceError`` (out of memory), as on a GPU. The bytes allocated live in
            host memory.
        profile: a device profile (:class:`DeviceProfile`, or the path of the file that
            ``python -m aiostream calibrate`` wrote): each engine's concurrency, each copy's
            latency and bandwidth (by direction, from pinned or pageable memory) and the
            kernels' launch overhead come from it, in place of ``compute_slots`` to
            ``d2d_bandwidth`` (giving one of those too is a ``ValueError``). None: the file
            named by the environment variable ``AIOSTREAM_VIRTUAL_PROFILE``, if set, unless
            one of ``compute_slots`` to ``d2d_bandwidth`` is given: the variable is a
            default, and options given explicitly win (no profile then). A file that is not
            a profile raises ``ValueError`` naming the file and the field.
    """
    options = VirtualOptions(
        devices=devices,
        compute_slots=compute_slots,
        h2d_slots=h2d_slots,
        d2h_slots=d2h_slots,
        bandwidth=bandwidth,
        latency=latency,
        d2d_bandwidth=d2d_bandwidth,
        memory=memory,
        profile=profile,
    )
    current = _backends.installed("virtual")
    isolation = current.isolation if isinstance(current, VirtualBackend) else None
    if isolation is not None:  # inside a test's virtual_device: keep its clock and checks
        if clock is None:
            clock = isolation.clock  # type: ignore[assignment] # what the fixture gave
        elif isolation.virtual_time:
            raise ValueError(
                "reset(clock=...) inside a virtual_time test would take the device off the "
                "test's virtual clock, which the loop's timers keep using; leave clock out "
                "(the reset keeps the test's clock)"
            )
    backend = VirtualBackend(options, clock=clock)
    backend.isolation = isolation
    old = _backends.replace("virtual", backend)
    if old is not None:
        if isolation is not None and isinstance(old, VirtualBackend):
            isolation.retire(old)  # what it leaked still fails the test
        old.close()


def submit(
    stream: Stream,
    duration: float,
    *,
    engine: str = "compute",
    fn: Callable[[], object] | None = None,
    error: str | None = None,
    name: str | None = None,
) -> None:
    """Enqueue one simulated operation of ``duration`` seconds on ``stream``.

    Args:
        stream: a stream of a virtual device.
        duration: seconds of device time (>= 0).
        engine: ``"compute"``, ``"h2d"`` or ``"d2h"``.
        fn: called, with no arguments, when the device reaches the operation's end (its
            effect: data moves when a copy completes, not when it is submitted). On a
            :class:`VirtualClock` it runs in the thread that advances the clock past that
            end; on the monotonic or a callable clock, in the first thread to look at the
            device after that instant (a wait, a query, any call into the backend). It runs
            under the backend's lock: keep it short and non-blocking. If it raises, the
            operation fails, and with it the device: waits raise ``DeviceError`` with the
            exception as ``__cause__``, sticky as every device error is.
        error: make the operation fail with this message. Waits on that work then raise
            ``DeviceError`` carrying it, and the device stays failed until :func:`reset`.
        name: a name for the timeline (default: the engine's name).
    """
    if not isinstance(stream, Stream):
        raise TypeError(f"stream must be an aiostream.Stream, got {stream!r}")
    if stream.device_type != "virtual":
        raise ValueError(f"submit() needs a stream of a virtual device, got one on {stream.device}")
    ns = seconds_to_ns(duration, "duration")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    if fn is not None and not callable(fn):
        raise TypeError(f"fn must be callable or None, got {fn!r}")
    if error is not None and not isinstance(error, str):
        raise TypeError(f"error must be a message (str) or None, got {error!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {name!r}")
    backend = _objects.backend(stream)
    assert isinstance(backend, VirtualBackend)
    if _diagnostics.debug:
        _objects.note_submission(stream)
    # the simulator records its own timeline: no profiler range; the direct call keeps the
    # cost per operation of a large simulation down
    backend.submit(_objects.handle(stream), ns, engine, fn, error, name or engine)


class Transfer:
    """Work outside the device that completes on the virtual backend's clock: a stand-in for a
    network transfer, a collective or a file read, for ``await aiostream.wait(transfer)``.

    Under virtual time (``run_in_virtual_time``, the ``virtual_time`` fixture) a pipeline that
    mixes device work and transfers is then exact and deterministic: the loop's poller of
    foreign handles wakes at the transfer's end (its adapter tells it when).

    Args:
        seconds: how long from now the transfer takes, in seconds of the device clock.
        error: the exception awaiting it raises once it is done (a failed transfer).
        name: what it is, for ``pending_waits()``.

    Example:
        >>> import aiostream as ais
        >>> from aiostream.testing import run_in_virtual_time
        >>> async def fetch():
        ...     await ais.wait(ais.virtual.Transfer(0.25))
        ...     return ais.virtual.now()
        >>> run_in_virtual_time(fetch)
        0.25
    """

    __slots__ = ("_backend", "_end", "error", "name")

    def __init__(
        self, seconds: float, *, error: BaseException | None = None, name: str = "transfer"
    ) -> None:
        ns = seconds_to_ns(seconds, "seconds")
        if error is not None and not isinstance(error, BaseException):
            raise TypeError(f"error must be an exception or None, got {error!r}")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        self._backend = _backend()
        self._end = self._now_ns() + ns
        self.error = error
        self.name = name

    def _now_ns(self) -> int:
        return round(self._backend.now() * 1e9)

    def done(self) -> bool:
        """Whether the clock has reached the transfer's end."""
        return self._now_ns() >= self._end

    def remaining(self) -> float:
        """Seconds of the device clock until the transfer's end (0.0 once done)."""
        return max(0, self._end - self._now_ns()) / 1e9

    def result(self) -> None:
        """Raise :attr:`error`, if the transfer was made to fail, once it is done."""
        if self.error is not None and self.done():
            raise self.error

    def describe(self) -> str:
        """What ``pending_waits()`` shows: the name and the end on the device clock."""
        return f"{self.name} ending at {self._end / 1e9:.9f} s"

    def __repr__(self) -> str:
        return f"<aiostream.virtual.Transfer {self.describe()}>"


def stats() -> VirtualStats:
    """Live streams, live events, pending operations and pending waits of the virtual backend."""
    return _backend().stats()


def timeline() -> list[OpRecord]:
    """The completed operations (up to the last 100,000), ordered by start, device and stream."""
    return _backend().timeline()


def races(*, clear: bool = False) -> list[Race]:
    """Host accesses to buffers made while a copy into them was in flight (the race detector).

    ``HostBuffer.numpy()`` on a buffer that an unfinished copy writes is recorded here, with
    where it happened. Reads through a view taken earlier are not seen; the destination then
    holds :data:`POISON` bytes until the copy lands, which a test can check instead.
    """
    return _backend().races(clear=clear)


def assert_no_races() -> None:
    """Raise ``AssertionError`` listing every race recorded so far (see :func:`races`)."""
    found = _backend().races(clear=True)
    if found:
        listing = "\n\n".join(str(r) for r in found)
        raise AssertionError(f"{len(found)} unsynchronised host access(es):\n{listing}")


def now() -> float:
    """The virtual backend's device clock, in seconds."""
    return _backend().now()


# ---------------------------------------------------------------------- fault injection


def _fault_target(
    stream: Stream | None, engine: str | None, device: Device | str | None
) -> tuple[VirtualBackend, int, Any, str | None]:
    if stream is not None:
        if not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream or None, got {stream!r}")
        if stream.device_type != "virtual":
            raise ValueError(f"needs a stream of a virtual device, got one on {stream.device}")
        if device is not None and _resolve_device(device) != stream.device:
            raise ValueError(f"stream is on {stream.device}, not on {device}")
        backend, index = _objects.backend(stream), stream.device_index
        handle = _objects.handle(stream)
    else:
        dev = _resolve_device(device if device is not None else "virtual:0")
        if dev.type != "virtual":
            raise ValueError(f"device must be a virtual device, got {dev}")
        backend, index, handle = _backend(), dev.index, None
    if engine is not None and engine not in ENGINES:
        raise ValueError(
            f"engine must be one of {', '.join(map(repr, ENGINES))} or None, got {engine!r}"
        )
    assert isinstance(backend, VirtualBackend)
    return backend, index, handle, engine


def fail_next(
    n: int = 1,
    *,
    stream: Stream | None = None,
    engine: str | None = None,
    device: Device | str | None = None,
    message: str = "injected fault",
) -> None:
    """Make the next ``n`` operations on ``stream`` (and/or ``engine``) fail with ``message``.

    With neither, any operation of ``device`` (``virtual:0`` by default) matches. The failure
    happens when the operation completes: waits on that work raise ``DeviceError`` carrying
    ``message``, and the device stays failed until :func:`reset`.
    """
    if not isinstance(message, str):
        raise TypeError(f"message must be a str, got {message!r}")
    backend, index, handle, engine = _fault_target(stream, engine, device)
    backend.inject(index, handle, engine, _count(n, "n"), message=message)


def slow_next(
    factor: float,
    n: int = 1,
    *,
    stream: Stream | None = None,
    engine: str | None = None,
    device: Device | str | None = None,
) -> None:
    """Make the next ``n`` operations on ``stream`` (and/or ``engine``) take ``factor`` times
    longer."""
    factor = _check.number(factor, "factor", positive=True)
    backend, index, handle, engine = _fault_target(stream, engine, device)
    backend.inject(index, handle, engine, _count(n, "n"), factor=factor)


class Stall:
    """An engine held stalled by :func:`stall`: no operation starts on it until released.

    Operations already running go on. Use it as a context manager, or call :meth:`release`.
    Stalls nest: the engine starts operations again when every stall on it is released.
    """

    def __init__(self, backend: VirtualBackend, index: int, engine: str) -> None:
        if not isinstance(backend, VirtualBackend):
            raise TypeError("a Stall is made by aiostream.virtual.stall(engine, device=...)")
        if engine not in ENGINES:
            names = ", ".join(map(repr, ENGINES))
            raise ValueError(f"engine must be one of {names}, got {engine!r}")
        index = _check.integer(index, "index", minimum=0)
        if index >= backend.device_count():
            raise ValueError(f"virtual:{index} does not exist ({backend.device_count()} device(s))")
        self._backend = backend
        self._index = index
        self.engine = engine
        self.released = False
        backend.stall(index, engine, True)

    def release(self) -> None:
        """Let the engine start operations again (idempotent); waits on them resume as usual."""
        if not self.released:
            self.released = True
            self._backend.stall(self._index, self.engine, False)

    def __enter__(self) -> Stall:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "stalled"
        return f"<aiostream.virtual.Stall virtual:{self._index} {self.engine} {state}>"


def stall(engine: str, *, device: Device | str | None = None) -> Stall:
    """Stall ``engine`` of ``device`` (``virtual:0`` by default) until the returned handle is
    released.

    Example:
        >>> with stall("h2d"):
        ...     pass  # copies queue up here; they start when the block exits
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    backend, index, _, _ = _fault_target(None, engine, device)
    return Stall(backend, index, engine)


def __dir__() -> list[str]:
    """The documented names only."""
    return sorted(__all__)
