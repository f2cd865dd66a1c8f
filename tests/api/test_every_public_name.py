"""Every public name, found by introspection, thrown arbitrary values: each call succeeds or
raises a documented error (``tests/helpers/fuzzing.py`` says which, and how a call is made and
judged).

TARGETS: every public callable of ``aiostream``, ``aiostream.virtual`` and ``aiostream.testing``
(their ``__all__``), and every public method and property of their classes (the protocol
methods that ``with``, ``async with``, ``str()``, ``==`` and the like call too). A method is
called on a fresh object on ``virtual:0`` (a factory per class, in FACTORIES, some in more than
one state: a profile not run, running and ended; a stale object from before a reset), with
arbitrary values for its parameters as its signature takes them (each odd, or of its annotated
type). What a function returns is used as users would (shown, entered, iterated once); a few
calls that set state are fuzzed once more followed by device work (THEN); EXPLICIT holds cases
known to have failed. A few calls document one more error of their own (DOCUMENTED_ALSO).

The problems of a group (a class, or a module's functions) are all listed, each with the exact
call that shows it. A guard test fails when a public name is neither fuzzed nor in EXCLUDED
(each with its reason).

``AIOSTREAM_FUZZ_EXAMPLES=500`` runs more examples per target (50 by default) for a deeper look.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import aiostream as ais
import aiostream.metrics
import aiostream.testing
import aiostream.tracing
from tests.helpers import lanes
from tests.helpers.fuzzing import (
    DOCUMENTED,
    ODD,
    Fresh,
    Problem,
    Raised,
    Target,
    attempt,
    identity,
    infinite_clock,
    invoke_function,
    invoke_member,
    nan_clock,
    nap,
    raising,
    reset_globals,
    running_profile,
    signature,
    wait,
)

PROTOCOL = frozenset(
    {
        "__enter__",
        "__exit__",
        "__aenter__",
        "__aexit__",
        "__await__",
        "__aiter__",
        "__anext__",
        "__iter__",
        "__next__",
        "__call__",
        "__str__",
        "__repr__",
        "__eq__",
        "__hash__",
        "__len__",
        "__bool__",
        "__contains__",
        "__getitem__",
        "__fspath__",
        "__index__",
        "__reduce__",
        "__cuda_stream__",
        "__cuda_array_interface__",
        "__array__",
        "__dlpack__",
    }
)


MODULES: dict[str, ModuleType] = {
    "aiostream": ais,
    "aiostream.virtual": ais.virtual,
    "aiostream.testing": aiostream.testing,
    "aiostream.tracing": aiostream.tracing,
    "aiostream.metrics": aiostream.metrics,
}


#: Public names not fuzzed, each with why it cannot be. ``Class.*`` covers a class's members.
EXCLUDED: dict[str, str] = {
    # constants and submodules: nothing to call
    "aiostream.__version__": "a str constant",
    "aiostream.virtual": "a submodule: its own names are fuzzed as aiostream.virtual.*",
    "aiostream.virtual.ENGINES": "a tuple constant",
    "aiostream.virtual.POISON": "an int constant",
    "aiostream.virtual.PROFILE_VARIABLE": "a str constant",
    "aiostream.tracing.Tracing.*": (
        "a listener made by instrument() (fuzzed), closed or used as a context manager: "
        "tests/profiler/test_tracing.py"
    ),
    "aiostream.metrics.PrometheusMetrics.*": (
        "close() and the context manager of the constructor fuzzed here: "
        "tests/profiler/test_metrics.py"
    ),
    "aiostream.virtual.DeviceProfile.*": (
        "a record read from a file: each field's refusal (the file and the field named) is "
        "tested in tests/virtual/test_profile.py; reset(profile=...) is fuzzed"
    ),
    "aiostream.virtual.PRIORITY_RANGE": "a tuple constant",
    # Only a live CUDA stream makes one (a made-up handle may crash the driver), and there is
    # none on a virtual device. Its constructor is fuzzed (on virtual:0 only, refused there);
    # its members are Stream's, fuzzed there (test_external_stream_adds_no_member_of_its_own).
    "aiostream.ExternalStream.*": "no instance without a live CUDA stream",
}


#: Errors that a call documents besides DOCUMENTED.
DOCUMENTED_ALSO: dict[str, tuple[type[BaseException], ...]] = {
    "aiostream.Profiler.export_chrome_trace": (OSError,),  # "the file cannot be written"
    "aiostream.Profiler.export_svg": (OSError,),
    "aiostream.Graph.debug_dump": (OSError,),
    "aiostream.virtual.assert_no_races": (AssertionError,),  # its whole point
    # CUDA devices only: elsewhere hasattr() is False, as interop libraries read the protocol
    "aiostream.DeviceBuffer.__cuda_array_interface__": (AttributeError,),
    # the array API standard's error for an export that cannot be made (copy=True, another
    # device, a dtype DLPack lacks), which consumers catch by its type
    "aiostream.DeviceBuffer.__dlpack__": (BufferError,),
    "aiostream.from_dlpack": (BufferError,),
    "aiostream.wait": (TimeoutError,),  # timeout= passed
    "aiostream.virtual.Transfer.result": (KeyError,),  # the failing transfer's own error
}


#: Examples per target (a target that takes no argument runs once).
MAX_EXAMPLES = lanes.examples(int(os.environ.get("AIOSTREAM_FUZZ_EXAMPLES", "50")))


def _arrays() -> list[np.ndarray]:
    return [np.arange(4, dtype=np.float32), np.ones(4, np.float32)]


async def _async_arrays() -> AsyncIterator[np.ndarray]:
    for array in _arrays():
        yield array


def _busy_stream() -> ais.Stream:
    stream = ais.Stream("virtual:0")
    ais.delay(0.001, stream=stream)
    return stream


def _timed_event() -> ais.Event:
    event = ais.Event("virtual:0", enable_timing=True)
    event.record(ais.Stream("virtual:0"))
    return event


def _captured_graph() -> ais.Graph:
    graph = ais.Graph("virtual:0", name="fuzzed")
    with graph.capture() as s:
        ais.delay(0.001, stream=s)
    return graph


def _stale(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make``, then the virtual backend replaced: the object is stale (StaleHandleError)."""

    def stale() -> Any:
        obj = make()
        ais.virtual.reset()
        return obj

    return stale


def _record() -> ais.virtual.OpRecord:
    return ais.virtual.OpRecord("k", 0, 3, "compute", 0.0, 0.5, 1.25, None)


#: Live objects, by name (the annotations' strategies pick among them).
LIVE_VALUES: dict[str, Fresh] = {
    "stream": Fresh("Stream('virtual:0')", lambda: ais.Stream("virtual:0")),
    "busy stream": Fresh("<Stream with 1 ms of work>", _busy_stream),
    "event": Fresh("Event('virtual:0')", lambda: ais.Event("virtual:0")),
    "timed event": Fresh("<recorded Event(enable_timing=True)>", _timed_event),
    "ipc event": Fresh(
        "Event('virtual:0', interprocess=True)", lambda: ais.Event("virtual:0", interprocess=True)
    ),
    "host buffer": Fresh("HostBuffer(16)", lambda: ais.HostBuffer(16, device="virtual:0")),
    "device buffer": Fresh("DeviceBuffer(16)", lambda: ais.DeviceBuffer(16, "virtual:0")),
    "device": Fresh("device('virtual:0')", lambda: ais.device("virtual:0")),
    "clock": Fresh("VirtualClock()", ais.virtual.VirtualClock),
    "arrays": Fresh("[two float32 arrays]", _arrays),
    "async arrays": Fresh("<async iterable of two float32 arrays>", _async_arrays),
    "records": Fresh("[OpRecord(...)]", lambda: [_record()]),
    "graph": Fresh("<captured Graph>", _captured_graph),
    "stale stream": Fresh("<Stream from before a reset>", _stale(_busy_stream)),
    "stale event": Fresh("<Event from before a reset>", _stale(_timed_event)),
    "stale buffer": Fresh(
        "<DeviceBuffer from before a reset>", _stale(lambda: ais.DeviceBuffer(16, "virtual:0"))
    ),
    "ipc handle": Fresh(
        "<an event IPC handle>", lambda: ais.Event("virtual:0", interprocess=True).ipc_handle()
    ),
}


CALLABLES: list[Callable[..., Any]] = [identity, infinite_clock, nan_clock, raising, nap]


LIVE = st.sampled_from([*LIVE_VALUES.values(), *CALLABLES])


#: An odd value, or (one time in four) a live object or a callable.
ARG = st.integers(0, 3).flatmap(lambda k: LIVE if k == 0 else ODD)


#: A device for calls that take a foreign handle: a virtual one, so that no handle reaches a
#: driver (a made-up one may crash it); None would mean cuda:0 there.
NOT_CUDA = ARG.filter(lambda v: v is not None and not (isinstance(v, str) and "cuda" in v))


#: A path for the exports, relative to the test's own directory: no text, which may name any
#: file, and no int, which is a file descriptor to open() (test_profiler.py checks those, with
#: the standard descriptors saved).
PATH = st.one_of(
    st.sampled_from([Path("out.trace"), "out.svg", "missing/dir/out", ""]),
    st.none(),
    st.floats(),
    st.lists(st.integers(-2, 4), max_size=2),
    st.sampled_from([object(), np.float32, np.dtype("f8"), np.float64("nan")]),
)


#: Keyword names for ``**kwargs``: the virtual backend's options, and any text.
KEYWORDS = st.one_of(
    st.sampled_from([*ais.virtual.VirtualOptions.names(), "clock", "device"]),
    st.text(max_size=6),
)


#: A loader's source: mostly one that works, so that the other arguments are reached.
SOURCE = st.integers(0, 3).flatmap(
    lambda k: (
        ARG if k == 0 else st.sampled_from([LIVE_VALUES["arrays"], LIVE_VALUES["async arrays"]])
    )
)


#: Parameters that take other values than ARG: (target, parameter) -> (strategy, always given)
OVERRIDES: dict[tuple[str, str], tuple[st.SearchStrategy[Any], bool]] = {
    ("aiostream.as_stream", "device"): (NOT_CUDA, True),
    ("aiostream.as_event", "device"): (NOT_CUDA, True),
    ("aiostream.ExternalStream", "device"): (NOT_CUDA, True),
    ("aiostream.Profiler.export_chrome_trace", "path"): (PATH, False),
    ("aiostream.Profiler.export_svg", "path"): (PATH, False),
    ("aiostream.Graph.debug_dump", "path"): (PATH, False),
    ("aiostream.DataLoader", "source"): (SOURCE, True),
}


#: Calls made before the arbitrary ones, by target: cases known to have failed.
EXPLICIT: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {
    # clocks that read what no clock reads (once an OverflowError at the first reading)
    "aiostream.virtual.reset": [
        ((), {"clock": infinite_clock}),
        ((), {"clock": nan_clock}),
        ((), {"clock": nap}),  # an async function: its coroutine is never awaited
    ],
    # host memory no machine has: a bare MemoryError from inside once
    "aiostream.HostBuffer": [((1 << 60,), {}), ((1 << 60,), {"pinned": False})],
    # a copy or an operation whose duration overflows the clock
    "aiostream.virtual.reset (then work)": [
        ((), {"bandwidth": 5e-324}),
        ((), {"d2d_bandwidth": 5e-324}),
    ],
    "aiostream.virtual.slow_next (then work)": [((1e300,), {}), ((1e300,), {"engine": "h2d"})],
    # the slots of a prefetch no memory holds, once allocated all at the first batch
    "aiostream.DataLoader": [
        ((LIVE_VALUES["arrays"],), {"prefetch": 1 << 40}),
        ((LIVE_VALUES["arrays"],), {"prefetch": 1 << 60, "workers": 2}),
    ],
}


def _batch() -> ais.Batch:
    async def first() -> ais.Batch:
        async for batch in ais.DataLoader(_arrays(), device="virtual:0"):
            return batch
        raise AssertionError("the loader gave no batch")

    return anyio.run(first)


def _profile(state: str) -> Callable[[], ais.Profiler]:
    def make() -> ais.Profiler:
        if state == "running":
            return running_profile("virtual:0")
        prof = ais.profile("virtual:0")
        if state == "ended":
            stream = ais.Stream("virtual:0")
            with prof:
                with ais.record_function("step", stream=stream):
                    ais.delay(0.0, stream=stream)
                stream.synchronize_blocking()
        return prof

    return make


def _summary() -> ais.Summary:
    return _profile("ended")().summary()


#: Class -> {variant: factory}: the objects whose members are fuzzed, made fresh per call.
FACTORIES: dict[type, dict[str, Callable[[], Any]]] = {
    ais.AiostreamError: {"": lambda: ais.AiostreamError("plain")},
    ais.Adapter: {"": lambda: ais.Adapter("fuzzed", done="done")},
    ais.CompletionError: {
        "": lambda: ais.CompletionError("asking raised", kind="fuzzed", subject="a handle")
    },
    ais.CaptureError: {"": lambda: ais.CaptureError("a capture refused it")},
    ais.GraphUpdateError: {"": lambda: ais.GraphUpdateError("refused", reason="topology")},
    ais.BackendUnavailableError: {"": lambda: ais.BackendUnavailableError("cuda", "no driver")},
    ais.Batch: {"": _batch},
    ais.CudaError: {
        "": lambda: ais.CudaError("failed", device="cuda:0", code=719, name="CUDA_ERROR")
    },
    ais.DataLoader: {
        "": lambda: ais.DataLoader(_arrays(), device="virtual:0"),
        "stale": _stale(lambda: ais.DataLoader(_arrays(), device="virtual:0")),
    },
    ais.Device: {"": lambda: ais.device("virtual:0")},
    ais.DeviceBuffer: {
        "": lambda: ais.DeviceBuffer(16, "virtual:0"),
        "stale": _stale(lambda: ais.DeviceBuffer(16, "virtual:0")),
    },
    ais.DeviceError: {"": lambda: ais.DeviceError("ECC error", device="virtual:0")},
    ais.Event: {
        "": lambda: ais.Event("virtual:0"),
        "recorded, timed": _timed_event,
        "stale": _stale(_timed_event),
    },
    ais.Graph: {
        "": lambda: ais.Graph("virtual:0"),
        "captured": _captured_graph,
        "stale": _stale(_captured_graph),
    },
    ais.HostBuffer: {
        "": lambda: ais.HostBuffer(16, device="virtual:0"),
        "stale": _stale(lambda: ais.HostBuffer(16, device="virtual:0")),
    },
    ais.LoaderStats: {"": lambda: ais.DataLoader(_arrays(), device="virtual:0").stats},
    ais.NotReadyError: {"": lambda: ais.NotReadyError("not yet")},
    ais.PendingWait: {"": lambda: ais.PendingWait("t", "stream 1", "virtual:0", 0.5, None, None)},
    ais.Profiler: {
        "": _profile("not run"),
        "running": _profile("running"),
        "ended": _profile("ended"),
        "running, stale": _stale(_profile("running")),
    },
    ais.Span: {"": lambda: ais.Span("host", "step", "MainThread", 0.0, 0.001)},
    ais.StaleHandleError: {"": lambda: ais.StaleHandleError("gone")},
    ais.Stream: {
        "": lambda: ais.Stream("virtual:0"),
        "busy": _busy_stream,
        "stale": _stale(_busy_stream),
    },
    ais.Summary: {"": _summary},
    ais.record_function: {
        "": lambda: ais.record_function("step", stream=ais.Stream("virtual:0"), k=1)
    },
    ais.virtual.OpRecord: {"": _record},
    ais.virtual.Race: {"": lambda: ais.virtual.Race(16, "'copy h2d'", "  File ...")},
    ais.virtual.Stall: {
        "": lambda: ais.virtual.stall("compute"),
        "stale": _stale(lambda: ais.virtual.stall("compute")),
    },
    ais.virtual.Transfer: {
        "": lambda: ais.virtual.Transfer(0.001),
        "failing": lambda: ais.virtual.Transfer(0.0, error=KeyError("lost")),
        "stale": _stale(lambda: ais.virtual.Transfer(0.001)),
    },
    ais.virtual.VirtualClock: {"": ais.virtual.VirtualClock},
    ais.virtual.VirtualOptions: {"": ais.virtual.VirtualOptions},
    ais.virtual.VirtualStats: {"": ais.virtual.stats},
    aiostream.testing.VirtualTime: {"": aiostream.testing.VirtualTime},
}


def submit_work() -> None:
    """A kernel and copies on a new stream, and the simulator's state read (no wait: a manual
    clock would never let one end)."""
    stream = ais.Stream("virtual:0")
    ais.delay(1.0, stream=stream)
    dst, src = ais.DeviceBuffer(16, "virtual:0"), ais.HostBuffer(16, device="virtual:0")
    ais.copy_async(dst, src, stream=stream)
    ais.copy_async(src, dst, stream=stream)
    ais.copy_async(ais.DeviceBuffer(16, "virtual:0"), dst, stream=stream)
    stream.query()
    ais.virtual.stats()
    ais.virtual.timeline()
    ais.virtual.now()


def submit_and_wait() -> None:
    """A kernel and a copy on a new stream, waited for: awaited, then blocking."""
    stream = ais.Stream("virtual:0")
    ais.delay(0.001, stream=stream)
    dst, src = ais.DeviceBuffer(16, "virtual:0"), ais.HostBuffer(16, device="virtual:0")
    ais.copy_async(dst, src, stream=stream)
    wait(stream.synchronize())
    ais.delay(0.001, stream=stream)
    stream.record_event().synchronize_blocking()


#: Calls whose effect shows in later device work: fuzzed once more, followed by that work.
THEN: dict[str, Callable[[], None]] = {
    "aiostream.virtual.reset": submit_work,
    "aiostream.virtual.slow_next": submit_work,
    "aiostream.virtual.fail_next": submit_and_wait,
    "aiostream.set_wait_strategy": submit_and_wait,
    "aiostream.set_watchdog": submit_and_wait,
    "aiostream.set_debug": submit_and_wait,
}


def _members(cls: type) -> dict[str, str]:
    """The public methods and properties of ``cls`` that aiostream defines: name -> kind."""
    found: dict[str, str] = {}
    for name in dir(cls):
        if name.startswith("_") and name not in PROTOCOL:
            continue
        owner = next(c for c in cls.__mro__ if name in vars(c))
        if not owner.__module__.startswith("aiostream"):
            continue  # object's, Exception's, collections.abc's
        raw = vars(owner)[name]
        if isinstance(raw, property):
            found[name] = "property"
        elif isinstance(raw, classmethod | staticmethod) or inspect.isfunction(raw):
            found[name] = "method"
        else:
            found[name] = "attribute"  # a field or slot: nothing to call
    return found


def public_names() -> dict[str, Any]:
    """Every public name: ``module.name`` for what modules export, ``module.Class.member`` for
    the methods and properties of the classes among them."""
    names: dict[str, Any] = {}
    for modname, module in MODULES.items():
        for name in module.__all__:
            obj = getattr(module, name)
            names[f"{modname}.{name}"] = obj
            if inspect.isclass(obj):
                for member, kind in _members(obj).items():
                    if kind != "attribute":
                        names[f"{modname}.{name}.{member}"] = (obj, member, kind)
    return names


def _excluded(name: str) -> bool:
    return name in EXCLUDED or any(
        key.endswith(".*") and name.startswith(key[:-1]) for key in EXCLUDED
    )


def _targets() -> dict[str, Target]:
    targets: dict[str, Target] = {}
    for name, obj in public_names().items():
        if _excluded(name):
            continue
        documented = DOCUMENTED + DOCUMENTED_ALSO.get(name, ())
        if isinstance(obj, tuple):  # a member of a class
            cls, member, kind = obj
            group = name.rsplit(".", 1)[0]
            raw = inspect.getattr_static(cls, member)
            if kind == "property":
                params: tuple[inspect.Parameter, ...] = ()
            elif isinstance(raw, staticmethod):
                params = signature(raw.__func__, bound=False)
            elif isinstance(raw, classmethod):
                params = signature(raw.__func__, bound=True)
            else:
                params = signature(raw, bound=True)
            for variant, make in FACTORIES.get(cls, {}).items():
                key = f"{name} ({variant})" if variant else name
                on = f"FACTORIES[{cls.__name__}][{variant!r}]"
                invoke = invoke_member(make, member, kind)
                targets[key] = Target(key, name, group, invoke, params, on, False, documented)
        elif callable(obj) and not isinstance(obj, ModuleType):
            module = name.rsplit(".", 1)[0]
            group = name if inspect.isclass(obj) else f"{module} functions"
            params = signature(obj, bound=False)
            targets[name] = Target(
                name, name, group, invoke_function(obj), params, "", True, documented
            )
            if name in THEN:
                key = f"{name} (then work)"
                targets[key] = Target(
                    key, name, group, invoke_function(obj), params, "", True, documented, THEN[name]
                )
    return targets


TARGETS = _targets()


GROUPS: dict[str, list[str]] = {}
for _key, _target in TARGETS.items():
    GROUPS.setdefault(_target.group, []).append(_key)


def _by_annotation() -> dict[str, st.SearchStrategy[Any]]:
    streams = [LIVE_VALUES[k] for k in ("stream", "busy stream", "stale stream")]
    events = [LIVE_VALUES[k] for k in ("event", "timed event", "ipc event", "stale event")]
    buffers = [LIVE_VALUES[k] for k in ("host buffer", "device buffer", "stale buffer")]
    sources = [LIVE_VALUES["arrays"], LIVE_VALUES["async arrays"]]
    exception = Fresh("Raised('x')", lambda: Raised("x"))
    return {
        "Stream": st.sampled_from(streams),
        "Event": st.sampled_from(events),
        "Buffer": st.sampled_from(buffers),
        "HostBuffer": st.just(buffers[0]),
        "DeviceBuffer": st.sampled_from(buffers[1:]),
        "Device": st.sampled_from([LIVE_VALUES["device"], "virtual:0", "virtual"]),
        "VirtualClock": st.just(LIVE_VALUES["clock"]),
        "str": st.sampled_from(["virtual:0", "compute", "h2d", "step", "poll", "asyncio", "x"]),
        "int": st.one_of(st.integers(0, 4), st.just(1 << 60)),
        "float": st.sampled_from([0.0, 0.001, 0.5, 2, 1e-9, 5e-324, 9.2e9, 1e300]),
        "bool": st.booleans(),
        "bytes": st.just(LIVE_VALUES["ipc handle"]),
        "Callable": st.sampled_from(CALLABLES),
        "Iterable": st.sampled_from(sources),
        "AsyncIterable": st.sampled_from(sources),
        "Sequence": st.just(LIVE_VALUES["records"]),
        "dict": st.sampled_from([{}, {"k": 1}]),
        "PathLike": st.just(Path("out.trace")),
        "None": st.none(),
        "type": st.sampled_from([None, Raised, ValueError]),
        "BaseException": st.sampled_from([None, exception]),
        "TracebackType": st.none(),
    }


BY_ANNOTATION = _by_annotation()


def plausible(annotation: Any) -> st.SearchStrategy[Any]:
    """Values of the types a parameter's annotation names (its text: the package writes
    ``from __future__ import annotations``); live objects where it names none."""
    words = re.findall(r"[A-Za-z_]\w*", annotation if isinstance(annotation, str) else "")
    found = [BY_ANNOTATION[w] for w in dict.fromkeys(words) if w in BY_ANNOTATION]
    return st.one_of(*found) if found else LIVE


@st.composite
def arguments(draw: st.DrawFn, target: Target) -> tuple[list[Any], dict[str, Any]]:
    """Values for ``target``'s parameters: every required one, and up to three of the optional
    ones (the positional ones before those keep their defaults); two more at most for ``*args``
    and ``**kwargs``. Each value is odd (ODD) or, half the time, of the annotated type."""
    P = inspect.Parameter

    def value(p: inspect.Parameter) -> Any:
        override = OVERRIDES.get((target.name, p.name))
        if override is not None:
            return draw(override[0], label=p.name)
        odd = draw(st.booleans(), label=f"odd {p.name}")
        return draw(ODD if odd else plausible(p.annotation), label=p.name)

    named = [p for p in target.params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    optional = [
        p.name
        for p in named
        if p.default is not P.empty and not OVERRIDES.get((target.name, p.name), (0, False))[1]
    ]
    chosen = draw(st.sets(st.sampled_from(optional), max_size=3) if optional else st.just(set()))
    given = {p.name for p in named if p.name not in optional or p.name in chosen}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = [p for p in named if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    last = max((i for i, p in enumerate(positional) if p.name in given), default=-1)
    for p in positional[: last + 1]:
        args.append(value(p) if p.name in given else p.default)
    for p in target.params:
        if p.kind is P.VAR_POSITIONAL:
            args += draw(st.lists(ARG, max_size=2), label=f"*{p.name}")
        elif p.kind is P.KEYWORD_ONLY and p.name in given:
            kwargs[p.name] = value(p)
        elif p.kind is P.VAR_KEYWORD:
            kwargs.update(draw(st.dictionaries(KEYWORDS, ARG, max_size=2), label=f"**{p.name}"))
    return args, kwargs


@pytest.fixture
def in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Relative paths (the exports') land in the test's own directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def fuzz(target: Target) -> list[Problem]:
    """Call ``target`` with its EXPLICIT cases, then with arbitrary arguments; return the
    distinct problems (one per error and place), each with the first call that showed it."""
    problems: dict[tuple[str, str], Problem] = {}

    def one(args: list[Any], kwargs: dict[str, Any]) -> None:
        if any(p.error == "hang" for p in problems.values()):
            return  # what a hung call holds (a lock) would hang the next ones too
        problem = attempt(target, args, kwargs)
        if problem is None or problem.error != "hang":
            reset_globals()
        if problem is not None:
            problems.setdefault((problem.error, problem.where), problem)

    for args, kwargs in EXPLICIT.get(target.key, []):
        one(list(args), dict(kwargs))

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],  # the problems are collected, not raised: nothing to shrink
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        one(*data.draw(arguments(target), label="arguments"))

    run()
    return list(problems.values())


@pytest.mark.hypothesis  # the draws are inside (fuzz): marked for the full lane's selection
@pytest.mark.usefixtures("in_tmp_dir")
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_public_name_succeeds_or_raises_a_documented_error(group: str) -> None:
    """Each target of the group (a class's constructor and members, or a module's functions);
    every problem of the group is listed, each with the exact call that shows it."""
    problems = [p.text for key in GROUPS[group] for p in fuzz(TARGETS[key])]
    assert not problems, f"{len(problems)} problem(s):\n\n" + "\n\n".join(problems)


def test_every_public_name_is_fuzzed_or_excluded_with_a_reason() -> None:
    names = public_names()
    fuzzed = {t.name for t in TARGETS.values()}
    wildcards = [key[:-1] for key in EXCLUDED if key.endswith(".*")]
    excluded = {n for n in names if n in EXCLUDED or any(n.startswith(w) for w in wildcards)}
    missing = sorted(set(names) - fuzzed - excluded)
    assert not missing, (
        f"public names neither fuzzed nor excluded: {missing}; add a factory to FACTORIES for "
        "a new class, or an entry to EXCLUDED saying why it cannot be fuzzed"
    )
    assert not fuzzed & excluded
    stale = sorted(k for k in EXCLUDED if not k.endswith(".*") and k not in names)
    stale += [w + "*" for w in wildcards if not any(n.startswith(w) for n in names)]
    assert not stale, f"EXCLUDED names what is no longer public: {stale}"
    configured = {t for t, _ in OVERRIDES} | set(DOCUMENTED_ALSO) | set(THEN)
    assert configured <= fuzzed, sorted(configured - fuzzed)
    assert set(EXPLICIT) <= set(TARGETS), sorted(set(EXPLICIT) - set(TARGETS))
    assert all(reason.strip() for reason in EXCLUDED.values())
    for cls in FACTORIES:  # every factory makes what it says
        for make in FACTORIES[cls].values():
            try:
                assert isinstance(make(), cls)
            finally:
                reset_globals()


def test_external_stream_adds_no_member_of_its_own() -> None:
    """Its members are Stream's, fuzzed there (an ExternalStream needs a live CUDA stream)."""
    own = {n for n in vars(ais.ExternalStream) if not n.startswith("__") or n in PROTOCOL}
    assert own <= {"__repr__"}, own
