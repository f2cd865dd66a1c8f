"""The pytest plugin of aiostream: virtual time, isolated virtual devices, and faults.

Installed with aiostream as the pytest plugin ``aiostream`` (entry point ``pytest11``: this
module; ``pytest -p aiostream.testing.plugin`` where aiostream is not installed). It works
beside pytest-asyncio and anyio's pytest plugin, in their strict modes. Fixtures, used by name
(they are not imported):

- ``virtual_device``: a fresh, isolated virtual backend for the test, yielding ``virtual:0``;
  configured by ``@pytest.mark.aiostream(devices=2, compute_slots=2, ...)``, on the test, its
  class or its module: their options merge, the closest to the test winning each one. At
  teardown it fails the test if a wait, operation, stream or event leaked, listing them, and
  restores the backend that was there before.
- ``virtual_time``: the test runs on a fake clock that jumps to the next timer or device
  completion whenever every task is blocked; ``asyncio.sleep``/``anyio.sleep`` and device work
  share it, so ten simulated seconds take microseconds. On asyncio's default loop and on trio;
  uvloop cannot take a fake clock, so such tests skip there, saying why.
- ``aiostream_device``: parametrized over every backend (``virtual:0``, and ``cuda:0``, which
  skips with the reason where no GPU works).

Outside pytest, :func:`aiostream.testing.run_in_virtual_time` runs an async function the same
way; :mod:`aiostream.testing` imports without pytest.

The option ``--aiostream-timelines=DIR`` writes each test's device timeline to
``DIR/<test id>.timeline`` (see :func:`aiostream.testing.format_timeline`), the id's
separators and characters no file name holds replaced by ``_``, and, where its parameters held
such characters or it is long, shortened and followed by a hash of the whole id.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import inspect
import re
import time
import types
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from .. import _backends, _distribution, _hooks
from .._backends.virtual import Isolation, VirtualBackend, VirtualOptions
from .._objects import DeviceObject
from .._virtual_time import Unsupported, VirtualTime, format_timeline, running
from ..device import Device

__all__ = ["aiostream_device", "virtual_device", "virtual_time"]

_OPTIONS = (*VirtualOptions.names(), "check_leaks", "check_races")
_TIME_KEY = pytest.StashKey[VirtualTime]()
_REPORT_KEY = pytest.StashKey[pytest.TestReport]()
#: the timelines --aiostream-timelines could not write: each test's id and the error
_UNWRITTEN_KEY = pytest.StashKey[list[str]]()
_NO_CUDA_KEY = pytest.StashKey[str]()
#: the skip reason of a cuda:0 parameter where CUDA does not work; why it does not is said
#: once, in the terminal summary, not in every skip line
_NO_CUDA = 'needs a CUDA GPU (why none works here: the "aiostream:" line above)'


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
    import aiostream

    shadowed = _distribution.shadowed(aiostream)
    if shadowed is not None:  # another project's aiostream/__init__.py replaced this one's
        raise pytest.UsageError(f"aiostream's pytest plugin: {shadowed}")
    folder = config.getoption("aiostream_timelines")
    if folder:  # a usage error now, not a failure in every test's teardown
        path = Path(folder)
        if path.exists() and not path.is_dir():
            raise pytest.UsageError(
                f"--aiostream-timelines={folder}: that is a file; give a folder (it is made "
                "if missing), where each test's timeline is written as <test id>.timeline"
            )
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise pytest.UsageError(f"--aiostream-timelines={folder}: {exc}") from None
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
    if not ok:
        metafunc.config.stash[_NO_CUDA_KEY] = reason
    cuda = pytest.param(
        "cuda:0", id="cuda:0", marks=() if ok else pytest.mark.skip(reason=_NO_CUDA)
    )
    metafunc.parametrize(
        "aiostream_device", [pytest.param("virtual:0", id="virtual:0"), cuda], indirect=True
    )


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    reason = config.stash.get(_NO_CUDA_KEY, None)
    if reason is not None:
        terminalreporter.write_line(f"aiostream: the cuda:0 tests skipped: {reason}")
    unwritten = config.stash.get(_UNWRITTEN_KEY, [])
    if unwritten:  # the tests' outcomes and checks stand: only their timelines are missing
        terminalreporter.write_line(
            f"aiostream: {len(unwritten)} timeline(s) could not be written; the first: "
            f"{unwritten[0]}"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" or (report.when == "setup" and not report.passed):
        item.stash[_REPORT_KEY] = report  # a setup that failed: the test never ran
    return report


_FIXTURES = ("virtual_device", "virtual_time", "aiostream_device")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("aiostream")
    if marker is None:
        return
    if not any(name in getattr(item, "fixturenames", ()) for name in _FIXTURES):
        pytest.fail(
            "@pytest.mark.aiostream(...) configures the virtual_device fixture, which this test "
            "does not use: add 'virtual_device' (or 'virtual_time') to its arguments",
            pytrace=False,
        )


# ---------------------------------------------------------------------- fixtures


def _marker_options(node: pytest.Item) -> dict[str, Any]:
    """The options of every ``aiostream`` marker on the test, its class and its module (and
    ``pytestmark``s), merged: where two give one option, the closest to the test wins."""
    options: dict[str, Any] = {}
    for marker in reversed(list(node.iter_markers("aiostream"))):  # the farthest first
        if marker.args:
            pytest.fail("@pytest.mark.aiostream takes keyword arguments only", pytrace=False)
        unknown = sorted(set(marker.kwargs) - set(_OPTIONS))
        if unknown:
            pytest.fail(
                f"@pytest.mark.aiostream got unknown option(s) {', '.join(unknown)}; "
                f"accepted: {', '.join(_OPTIONS)}",
                pytrace=False,
            )
        options.update(marker.kwargs)
    for name in ("check_leaks", "check_races"):
        value = options.get(name, True)
        if not isinstance(value, bool):
            pytest.fail(
                f"@pytest.mark.aiostream({name}=...) takes True or False, got {value!r}",
                pytrace=False,
            )
    return options


#: the longest test id kept whole in a timeline's file name (file systems allow 255 bytes)
_NAME_MAX = 150


def _timeline_path(config: pytest.Config, nodeid: str) -> Path | None:
    """The file of a test's timeline: its id, with the path's separators and characters a
    file name cannot hold replaced by ``_``, cut to ``_NAME_MAX`` characters, and a hash of
    the whole id. The hash is always there: replaced characters (``a/b.py`` and ``a_b.py``),
    a cut, or ids that differ in case only (one file on macOS and Windows) would otherwise
    give two tests one file."""
    folder = config.getoption("aiostream_timelines")
    if not folder:
        return None
    name = re.sub(r"[^A-Za-z0-9_.\-\[\]]+", "_", nodeid).strip("_")
    digest = hashlib.sha1(nodeid.encode(), usedforsecurity=False).hexdigest()[:12]
    return Path(folder) / f"{name[:_NAME_MAX]}-{digest}.timeline"


@pytest.fixture
def virtual_device(request: pytest.FixtureRequest) -> Iterator[Device]:
    """A fresh virtual backend for this test, checked for leaks at teardown; yields ``virtual:0``.

    It is also the default device during the test, on machines with a GPU too.
    """
    options = _marker_options(request.node)
    check_leaks = options.pop("check_leaks", True)
    check_races = options.pop("check_races", True)
    try:
        virtual_options = VirtualOptions.from_kwargs(**options)
    except (TypeError, ValueError) as exc:
        pytest.fail(f"@pytest.mark.aiostream(...): {exc}", pytrace=False)
    clock: Any = None
    in_virtual_time = "virtual_time" in request.fixturenames
    if in_virtual_time:
        vtime = VirtualTime()
        request.node.stash[_TIME_KEY] = vtime
        clock = vtime  # it refuses waits outside the test body, which could not end
    backend = VirtualBackend(virtual_options, clock=clock)
    isolation = backend.isolation = Isolation(clock, virtual_time=in_virtual_time)
    previous = _backends.replace("virtual", backend)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AIOSTREAM_DEVICE", "virtual:0")
            yield Device("virtual", 0)
    finally:
        gc.collect()  # objects the test dropped release their handles now
        live = _backends.installed("virtual")  # another, if the test called reset()
        if not (isinstance(live, VirtualBackend) and live.isolation is isolation):
            live = backend
        held = _held_by_fixtures(request.node) + _held_by_listeners()
        leaks = isolation.leaks + _settled_leaks(live, held)
        races = isolation.races + live.races()
        timeline = live.timeline()
        _backends.restore("virtual", previous)
        live.close()
        backend.close()
    path = _timeline_path(request.config, request.node.nodeid)
    if path is not None:
        try:
            path.write_text(format_timeline(timeline))
        except OSError as exc:  # the folder went, the disk is full: said at the end
            unwritten = request.config.stash.setdefault(_UNWRITTEN_KEY, [])
            unwritten.append(f"{request.node.nodeid}: {exc}")
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


#: how long a test's objects, and only objects (no pending work), may take to be let go
_OBJECTS_GRACE_S = 0.5


#: the most objects looked at for what a test's fixture values hold
_HELD_MOST = 100_000
#: what is never looked into for them: code, and what reaches everything from there
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
    types.GeneratorType,
    types.CoroutineType,
)

#: ... nor the objects of these modules: backends reach all their objects, pytest's fixtures
#: (capsys, request) every test's
_NOT_LOOKED_INTO = ("aiostream._backends.", "_pytest.", "pytest", "pluggy")


def _held_by_fixtures(item: pytest.Item) -> list[object]:
    """The handles of the aiostream objects (streams, events, buffers) that the test's
    fixture values hold, in containers and objects too: pytest holds those values until the
    test's teardown has ended, after the leak check, so they are no leak of the test's. Their
    pending work still is (it is listed apart from the objects)."""
    funcargs = getattr(item, "funcargs", None) or {}
    todo = list(funcargs.values())
    seen: set[int] = set()
    held: list[object] = []
    while todo and len(seen) < _HELD_MOST:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, DeviceObject):
            handle = getattr(obj, "_handle", None)
            if handle is not None:
                held.append(handle)
            continue  # the rest of it is its backend's
        if type(obj).__module__.startswith(_NOT_LOOKED_INTO):
            continue
        todo.extend(gc.get_referents(obj))
    return held


def _held_by_listeners() -> list[object]:
    """The handles of the device objects aiostream's listeners keep for themselves while
    they listen (``aiostream.tracing``'s anchor events), which no test leaked."""
    return [
        obj._handle  # noqa: SLF001 - aiostream's own
        for obj in _hooks.held()
        if isinstance(obj, DeviceObject) and obj._handle is not None  # noqa: SLF001
    ]


def _settled_leaks(backend: VirtualBackend, held: list[object]) -> list[str]:
    """What ``backend`` still holds. Where that is only objects (streams, events, buffers),
    looked at again for up to half a second, collecting each time: a thread of a pool that
    ran the test's last call (``anyio.to_thread.run_sync(s.synchronize_blocking)``) may hold
    that call, and what it reaches, a moment after it has reported its result. Pending work
    is never waited for: it is told at once."""
    leaks = backend.leaks(held)
    deadline = time.monotonic() + _OBJECTS_GRACE_S
    while leaks and all(line.startswith("live ") for line in leaks):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
        gc.collect()
        leaks = backend.leaks(held)
    return leaks


@pytest.fixture
def virtual_time(request: pytest.FixtureRequest, virtual_device: Device) -> Iterator[VirtualTime]:
    """Run the test body on a fake clock shared by loop timers and device work."""
    item = request.node
    vtime = item.stash.get(_TIME_KEY, None)
    if vtime is None:  # not among the test's fixtures when virtual_device was set up
        pytest.fail(
            "virtual_time runs the test function itself on a fake clock, so it must be one of "
            "the test's fixtures from the start: name it as an argument of the test (or in "
            "@pytest.mark.usefixtures), not through request.getfixturevalue()",
            pytrace=False,
        )
    original = item.obj
    if not inspect.iscoroutinefunction(original):
        pytest.fail(
            "virtual_time needs an async test function, run by pytest-asyncio or anyio",
            pytrace=False,
        )
    funcargs = item.funcargs
    anyio_backend = funcargs.get("anyio_backend")
    if anyio_backend is not None:
        name, options = (anyio_backend, {}) if isinstance(anyio_backend, str) else anyio_backend
        if name == "trio" and "clock" not in options:
            import trio.testing

            mock = trio.testing.MockClock(autojump_threshold=0)
            funcargs["anyio_backend"] = (name, {**options, "clock": mock})

    @functools.wraps(original)
    async def in_virtual_time(*args: Any, **kwargs: Any) -> Any:
        try:
            with running(vtime):
                return await original(*args, **kwargs)
        except Unsupported as exc:
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
