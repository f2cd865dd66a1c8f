"""Virtual time: a fake clock shared by the event loop's timers and the virtual device, for
tests (through the pytest plugin, :mod:`aiostream.testing.plugin`) and for simulations and
benchmarks outside pytest (:func:`run_in_virtual_time`). Needs no pytest.

It sits below what uses it: :mod:`aiostream.testing` re-exports its public names, the plugin
binds it to a test, and ``_bench.calibrate`` runs a virtual device on it; none of the library
imports :mod:`aiostream.testing` (``lint-imports`` says so). On asyncio, the loop's clock is made
virtual by :mod:`.asyncio_clock` (trio has its own ``MockClock``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import anyio
import sniffio

from .. import _backends
from .._backends.virtual import OpRecord, VirtualBackend, VirtualOptions
from . import asyncio_clock

_TRIO_CLOCK_HINT = (
    "virtual_time on trio needs trio's MockClock; the plugin gives anyio's runner one, but this "
    "test's run had already started (an async fixture?) with another clock. Give it yourself: "
    "return ('trio', {'clock': trio.testing.MockClock(autojump_threshold=0)}) from the "
    "anyio_backend fixture."
)


def format_timeline(records: Sequence[OpRecord]) -> str:
    """A device timeline as canonical text: one line per operation, times to the nanosecond.

    The same test gives the same text, byte for byte, on every run and on every loop.

    Args:
        records: the operations, as ``aiostream.virtual.timeline()`` returns them (a sequence
            of :class:`aiostream.virtual.OpRecord`, such as a list).

    Raises:
        TypeError: ``records`` is not a sequence (a str is none) of ``OpRecord``.
    """
    if (
        not isinstance(records, Sequence)
        or isinstance(records, (str, bytes, bytearray))
        or not all(isinstance(r, OpRecord) for r in records)
    ):
        raise TypeError(
            "records must be a sequence of aiostream.virtual.OpRecord (a list, as "
            f"aiostream.virtual.timeline() returns), got {records!r}"
        )
    lines = ["# device stream engine start end name error"]
    for r in records:
        lines.append(
            f"virtual:{r.device} {r.stream} {r.engine} {r.start:.9f} {r.end:.9f} "
            f"{r.name!r} {r.error!r}"
        )
    return "\n".join(lines) + "\n"


STOPPED = (
    "this wait would never end: virtual_time's clock runs only while the test function runs "
    "(fixtures' setup and teardown run before and after it, on a clock standing still); "
    "await device work in the test function itself, or submit it in the fixture and await "
    "it in the test, or use virtual_device without virtual_time (real time)"
)


class Unsupported(Exception):
    """Virtual time cannot run on this loop; ``skip`` says whether a test should skip."""

    def __init__(self, message: str, *, skip: bool) -> None:
        super().__init__(message)
        self.skip = skip


class VirtualTime:
    """The fake clock of a ``virtual_time`` test: loop timers and device work share it.

    It reads 0.0 when the test body starts and moves only when every task is blocked, jumping
    to the next timer or device completion.
    """

    def __init__(self) -> None:
        self._read: Any = None
        self._frozen = 0.0
        self._stopped_callbacks: list[Callable[[], None]] = []
        self.loop: str | None = None
        """``"asyncio"`` or ``"trio"`` once the test runs."""

    def now(self) -> float:
        """Seconds of virtual time since the test body started: whole nanoseconds, as the
        virtual device reads them (``0.3`` after three waits of ``0.1``, where the loop's own
        float clock says ``0.30000000000000004``)."""
        return self.now_ns() / 1e9

    def now_ns(self) -> int:
        """Nanoseconds of virtual time since the test body started."""
        seconds = self._read() if self._read is not None else self._frozen
        return round(seconds * 1_000_000_000)

    def __call__(self) -> float:
        """The device's clock: :meth:`now`."""
        return self.now()

    def _aiostream_stopped(self) -> str | None:
        """Why the clock stands still now (outside the test body), or None while it runs:
        what the virtual device asks its clock (``simulation.py``), refusing a wait that
        could not end."""
        if self._read is not None:
            return None
        return STOPPED

    def _aiostream_on_stop(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called when the clock stops (the test body ended): the virtual
        device wakes the waits still pending then, which raise why."""
        self._stopped_callbacks.append(callback)


@contextlib.contextmanager
def running(vtime: VirtualTime) -> Iterator[None]:
    """Install the fake clock on the running loop for the duration of the test body."""
    vtime.loop = sniffio.current_async_library()
    with _loop_clock(vtime.loop) as read:
        vtime._read = read  # noqa: SLF001 (VirtualTime is this module's)
        try:
            yield
        finally:
            vtime._frozen, vtime._read = vtime.now(), None  # noqa: SLF001 (this module's)
            # The waits pending now wake on the loop's next turn, which is the next of
            # pytest's steps (a fixture's teardown): anyio's runner runs the test and its
            # fixtures in one task, and a fixture's task group whose task failed between two
            # steps would cancel that task while it waits for the next one, which then hangs.
            soon = _soon(vtime.loop)
            for callback in vtime._stopped_callbacks:  # noqa: SLF001 (this module's)
                soon(callback)


def _soon(library: str) -> Callable[[Callable[[], None]], object]:
    """What schedules a callback on the running loop's next turn."""
    if library == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    return asyncio.get_running_loop().call_soon


@contextlib.contextmanager
def _loop_clock(library: str) -> Iterator[Callable[[], float]]:
    """Fake the running loop's clock for a block; yield what reads its seconds since then."""
    if library == "trio":
        import trio
        import trio.testing

        clock = trio.lowlevel.current_clock()
        if not isinstance(clock, trio.testing.MockClock):
            raise Unsupported(_TRIO_CLOCK_HINT, skip=False)
        threshold, clock.autojump_threshold = clock.autojump_threshold, 0
        base = clock.current_time()
        try:
            yield lambda: clock.current_time() - base
        finally:
            clock.autojump_threshold = threshold
        return
    loop = asyncio.get_running_loop()
    if not asyncio_clock.supported(loop):
        kind = f"{type(loop).__module__}.{type(loop).__name__}"
        raise Unsupported(
            f"virtual_time cannot fake the clock of {kind} (uvloop keeps its own, in "
            "libuv); run this test on asyncio's default loop or on trio",
            skip=True,
        )
    fake = asyncio_clock.FakeLoopTime(loop)
    with fake.installed():
        yield fake.time


T = TypeVar("T")


def run_in_virtual_time(
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    backend: str = "asyncio",
    **options: Any,
) -> T:
    """Run ``await fn(*args)`` on a fresh virtual backend whose clock is a fake loop clock.

    Loop timers and device work share one virtual clock that jumps whenever every task is
    blocked, so simulated seconds take microseconds and the result is exact. For simulations
    and benchmarks outside pytest; the previous virtual backend is restored afterwards.

    Args:
        fn: an async function.
        backend: ``"asyncio"`` (its default loop) or ``"trio"``.
        options: virtual backend options, as for ``aiostream.virtual.reset()`` (not ``clock``).

    Example:
        >>> import aiostream as ais
        >>> async def ten_seconds():
        ...     ais.delay(10.0)
        ...     await ais.current_stream().synchronize()
        ...     return ais.virtual.now()
        >>> run_in_virtual_time(ten_seconds)
        10.0
    """
    if backend not in ("asyncio", "trio"):
        raise ValueError(f"backend must be 'asyncio' or 'trio', got {backend!r}")
    vtime = VirtualTime()
    virtual = VirtualBackend(VirtualOptions.from_kwargs(**options), clock=vtime)
    previous = _backends.replace("virtual", virtual)

    async def main() -> T:
        with running(vtime):
            return await fn(*args)

    try:
        if backend == "trio":
            import trio.testing

            clock = trio.testing.MockClock(autojump_threshold=0)
            return anyio.run(main, backend="trio", backend_options={"clock": clock})
        return anyio.run(main, backend="asyncio", backend_options={"use_uvloop": False})
    finally:
        _backends.restore("virtual", previous)
        virtual.close()
