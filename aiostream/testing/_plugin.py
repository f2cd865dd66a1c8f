"""The pytest plugin behind :mod:`aiostream.testing`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import re
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
import sniffio

from .. import _backends
from .._backends.virtual import OpRecord, VirtualBackend, VirtualOptions
from ..device import Device
from . import _fake_time

_OPTIONS = (*VirtualOptions.names(), "check_leaks", "check_races")
_TIME_KEY = pytest.StashKey["VirtualTime"]()
_REPORT_KEY = pytest.StashKey[pytest.TestReport]()
_TRIO_CLOCK_HINT = (
    "virtual_time on trio needs trio's MockClock; the plugin gives anyio's runner one, but this "
    "test's run had already started (an async fixture?) with another clock. Give it yourself: "
    "return ('trio', {'clock': trio.testing.MockClock(autojump_threshold=0)}) from the "
    "anyio_backend fixture."
)


def format_timeline(records: Sequence[OpRecord]) -> str:
    """A device timeline as canonical text: one line per operation, times to the nanosecond.

    The same test gives the same text, byte for byte, on every run and on every loop.
    """
    lines = ["# device stream engine start end name error"]
    for r in records:
        lines.append(
            f"virtual:{r.device} {r.stream} {r.engine} {r.start:.9f} {r.end:.9f} "
            f"{r.name!r} {r.error!r}"
        )
    return "\n".join(lines) + "\n"


class _Unsupported(Exception):
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
        self.loop: str | None = None
        """``"asyncio"`` or ``"trio"`` once the test runs."""

    def now(self) -> float:
        """Seconds of virtual time since the test body started."""
        return self._read() if self._read is not None else self._frozen

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Install the fake clock on the running loop for the duration of the test body."""
        library = sniffio.current_async_library()
        self.loop = library
        if library == "trio":
            import trio
            import trio.testing

            clock = trio.lowlevel.current_clock()
            if not isinstance(clock, trio.testing.MockClock):
                raise _Unsupported(_TRIO_CLOCK_HINT, skip=False)
            threshold, clock.autojump_threshold = clock.autojump_threshold, 0
            base = clock.current_time()
            self._read = lambda: clock.current_time() - base
            try:
                yield
            finally:
                self._frozen = self.now()
                self._read = None
                clock.autojump_threshold = threshold
            return
        loop = asyncio.get_running_loop()
        if not _fake_time.supported(loop):
            kind = f"{type(loop).__module__}.{type(loop).__name__}"
            raise _Unsupported(
                f"virtual_time cannot fake the clock of {kind} (uvloop keeps its own, in "
                "libuv); run this test on asyncio's default loop or on trio",
                skip=True,
            )
        fake = _fake_time.FakeLoopTime(loop)
        with fake.installed():
            self._read = fake.time
            try:
                yield
            finally:
                self._frozen = self.now()
                self._read = None


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
    virtual = VirtualBackend(VirtualOptions.from_kwargs(**options), clock=vtime.now)
    previous = _backends.replace("virtual", virtual)

    async def main() -> T:
        with vtime._running():
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


# ---------------------------------------------------------------------- hooks


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aiostream")
    group.addoption(
        "--aiostream-timelines",
        metavar="DIR",
        default=None,
        help="write the device timeline of each test that uses virtual_device to DIR",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "aiostream(devices=1, compute_slots=1, h2d_slots=1, d2h_slots=1, bandwidth=25e9, "
        "latency=10e-6, d2d_bandwidth=1e12, check_leaks=True, check_races=True): configure "
        "the virtual_device fixture",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "aiostream_device" not in metafunc.fixturenames:
        return
    ok, reason = _backends.probe("cuda")
    cuda = pytest.param(
        "cuda:0",
        id="cuda:0",
        marks=() if ok else pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}"),
    )
    metafunc.parametrize(
        "aiostream_device", [pytest.param("virtual:0", id="virtual:0"), cuda], indirect=True
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_REPORT_KEY] = report
    return report


# ---------------------------------------------------------------------- fixtures


def _marker_options(node: pytest.Item) -> dict[str, Any]:
    marker = node.get_closest_marker("aiostream")
    if marker is None:
        return {}
    if marker.args:
        pytest.fail("@pytest.mark.aiostream takes keyword arguments only", pytrace=False)
    unknown = sorted(set(marker.kwargs) - set(_OPTIONS))
    if unknown:
        pytest.fail(
            f"@pytest.mark.aiostream got unknown option(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(_OPTIONS)}",
            pytrace=False,
        )
    return dict(marker.kwargs)


def _timeline_path(config: pytest.Config, nodeid: str) -> Path | None:
    folder = config.getoption("aiostream_timelines")
    if not folder:
        return None
    name = re.sub(r"[^A-Za-z0-9_.\-\[\]]+", "_", nodeid).strip("_")
    return Path(folder) / f"{name}.timeline"


@pytest.fixture
def virtual_device(request: pytest.FixtureRequest) -> Iterator[Device]:
    """A fresh virtual backend for this test, checked for leaks at teardown; yields ``virtual:0``.

    It is also the default device during the test, on machines with a GPU too.
    """
    options = _marker_options(request.node)
    check_leaks = options.pop("check_leaks", True)
    check_races = options.pop("check_races", True)
    virtual_options = VirtualOptions.from_kwargs(**options)
    clock: Any = None
    if "virtual_time" in request.fixturenames:
        vtime = VirtualTime()
        request.node.stash[_TIME_KEY] = vtime
        clock = vtime.now
    backend = VirtualBackend(virtual_options, clock=clock)
    previous = _backends.replace("virtual", backend)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AIOSTREAM_DEVICE", "virtual:0")
            yield Device("virtual", 0)
    finally:
        gc.collect()  # objects the test dropped release their handles now
        leaks = backend.leaks()
        races = backend.races()
        timeline = backend.timeline()
        _backends.restore("virtual", previous)
        backend.close()
    path = _timeline_path(request.config, request.node.nodeid)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(format_timeline(timeline))
    report = request.node.stash.get(_REPORT_KEY, None)
    passed = report is None or report.passed
    if races and check_races and passed:
        listing = "\n\n".join(str(r) for r in races)
        pytest.fail(
            f"the test touched {len(races)} host buffer(s) while a copy into them was in "
            f"flight; await the copy's event or stream first:\n{listing}\n(or mark the test "
            "@pytest.mark.aiostream(check_races=False))",
            pytrace=False,
        )
    if leaks and check_leaks and passed:
        listing = "\n".join(f"  - {line}" for line in leaks)
        pytest.fail(
            f"the test leaked {len(leaks)} thing(s) on the virtual backend:\n{listing}\n"
            "Await the work you submit, and drop streams and events before the test ends "
            "(or mark the test @pytest.mark.aiostream(check_leaks=False)).",
            pytrace=False,
        )


@pytest.fixture
def virtual_time(request: pytest.FixtureRequest, virtual_device: Device) -> Iterator[VirtualTime]:
    """Run the test body on a fake clock shared by loop timers and device work."""
    item = request.node
    vtime = item.stash[_TIME_KEY]
    original = item.obj
    if not inspect.iscoroutinefunction(original):
        pytest.fail(
            "virtual_time needs an async test function, run by pytest-asyncio or anyio",
            pytrace=False,
        )
    funcargs = item.funcargs
    anyio_backend = funcargs.get("anyio_backend")
    if anyio_backend is not None:
        name, options = (
            (anyio_backend, {}) if isinstance(anyio_backend, str) else anyio_backend
        )
        if name == "trio" and "clock" not in options:
            import trio.testing

            mock = trio.testing.MockClock(autojump_threshold=0)
            funcargs["anyio_backend"] = (name, {**options, "clock": mock})

    @functools.wraps(original)
    async def in_virtual_time(*args: Any, **kwargs: Any) -> Any:
        try:
            with vtime._running():
                return await original(*args, **kwargs)
        except _Unsupported as exc:
            if exc.skip:
                pytest.skip(str(exc))
            pytest.fail(str(exc), pytrace=False)

    item.obj = in_virtual_time
    try:
        yield vtime
    finally:
        item.obj = original
        if anyio_backend is not None:
            funcargs["anyio_backend"] = anyio_backend


@pytest.fixture
def aiostream_device(request: pytest.FixtureRequest) -> Device:
    """Every backend: a fresh ``virtual:0`` (see ``virtual_device``), and ``cuda:0`` with a GPU."""
    spec = getattr(request, "param", "virtual:0")
    if spec.startswith("virtual"):
        device: Device = request.getfixturevalue("virtual_device")
        return device
    from ..device import device as resolve

    return resolve(spec)
