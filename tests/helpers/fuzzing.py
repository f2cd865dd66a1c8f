"""The machinery of the public calls' fuzzers (``tests/api/test_bad_input.py`` and
``tests/api/test_every_public_name.py``): odd values, a call made as a user would in a thread
of its own under a memory cap, and the judgement of what it raised.

Documented errors: TypeError and ValueError for bad arguments, and aiostream's own errors (a
device that is unavailable here, out of memory, or failed; a misuse, such as reading a profile
that has not run). No call documents MemoryError: host memory the machine cannot give is a
DeviceError. Anything else (OverflowError, ZeroDivisionError, AttributeError, AssertionError,
RuntimeError, a bare MemoryError from deep inside, a hang) is a defect. Sizes are kept to the
small and the absurd (none in between, which a machine might really try to allocate).

Async calls are awaited on asyncio, for at most ASYNC_TIMEOUT seconds; every call runs in a
thread of its own that is given at most CALL_TIMEOUT seconds: a call that takes longer hangs,
which is a defect. An exception that nothing could raise (a coroutine never awaited) is one
too. A call's data memory is capped a little above what the process holds, so that an absurd
allocation fails at once.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import math
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
from hypothesis import strategies as st

import aiostream as ais

try:
    import resource
except ImportError:  # Windows: no memory cap
    resource = None  # type: ignore[assignment]

DOCUMENTED = (TypeError, ValueError, ais.AiostreamError)


ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 64),
    st.sampled_from([-(1 << 70), 1 << 60, 1 << 63, 1 << 70, 2**64 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e300, -0.0, 5e-324]),
    st.text(max_size=12),
    st.sampled_from(
        [
            "virtual",
            "virtual:0",
            "virtual:9",
            "cuda:0",
            "cuda",
            "gpu",
            "",
            "hybrid",
            "compute",
            "h2d",
            "d2h",
            "float32",
            "uint8",
        ]
    ),
    st.binary(max_size=70),
    st.lists(st.integers(-2, 4), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
    st.just(object()),
    st.just(np.float32),
    st.just(np.dtype("f8")),
    st.sampled_from([np.int64(3), np.int64(-1), np.float64("nan")]),
)


#: Seconds an awaited call may take (none here waits for long: a few ms of device work at most).
ASYNC_TIMEOUT = 5.0


#: Seconds any call may take, in its own thread, before it counts as hung.
CALL_TIMEOUT = 15.0


#: How much more data memory than the process holds a call may take: an absurd size then fails
#: at once (as it would on a smaller machine) instead of taking the machine's memory.
MEMORY_HEADROOM = 256 << 20


class Raised(Exception):
    """What the callables this test hands over raise: the user's own error, which a call may
    let through (a transform, an async function run in virtual time)."""


class Hang(Exception):
    """An awaited call took longer than ASYNC_TIMEOUT."""


class Fresh:
    """A live object made at call time, on the virtual backend of that moment (the values of an
    example are drawn before the previous example's reset)."""

    __slots__ = ("label", "make")

    def __init__(self, label: str, make: Callable[[], Any]) -> None:
        self.label = label
        self.make = make

    def __repr__(self) -> str:
        return self.label


def resolve(value: Any) -> Any:
    return value.make() if isinstance(value, Fresh) else value


# callables handed to calls that take one (a clock, a transform, a function to run)
def identity(x: Any = None) -> Any:
    return x


def infinite_clock() -> float:
    return math.inf


def nan_clock() -> float:
    return math.nan


def raising(*args: Any, **kwargs: Any) -> Any:
    raise Raised("the user's callable raised")


async def nap(*args: Any, **kwargs: Any) -> None:
    await anyio.sleep(0)


#: Protocol methods that open something: the call is followed by its closing partner.
PAIRED = {"__enter__": "__exit__", "__aenter__": "__aexit__"}


@dataclass(frozen=True)
class Target:
    """One public name to call: how, and with what parameters."""

    key: str
    """Its key in TARGETS: the name, and the factory's variant in parentheses if it has one."""
    name: str
    """The public name it covers."""
    group: str
    """Its class (constructor and members), or its module (functions)."""
    invoke: Callable[[list[Any], dict[str, Any]], Any]
    params: tuple[inspect.Parameter, ...]
    on: str = ""
    """The object it is called on: where in FACTORIES it comes from."""
    use_result: bool = False
    """Use what the call returns as users would: ``with``, ``async with``, ``async for``."""
    documented: tuple[type[BaseException], ...] = field(default=DOCUMENTED)
    then: Callable[[], None] | None = None
    """Device work done after the call, where what it set shows only then (THEN)."""


def signature(fn: Any, *, bound: bool) -> tuple[inspect.Parameter, ...]:
    try:
        params = tuple(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without one (an exception's constructor)
        params = (inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),)
    return params[1:] if bound else params


def invoke_member(
    make: Callable[[], Any], member: str, kind: str
) -> Callable[[list[Any], dict[str, Any]], Any]:
    def invoke(args: list[Any], kwargs: dict[str, Any]) -> Any:
        obj = make()
        if kind == "property":
            return getattr(obj, member)
        result = getattr(obj, member)(*args, **kwargs)
        partner = PAIRED.get(member)
        if partner is None:
            return result
        if inspect.isawaitable(result):

            async def both() -> None:
                await result
                await getattr(obj, partner)(None, None, None)

            return both()
        getattr(obj, partner)(None, None, None)
        return result

    return invoke


def invoke_function(fn: Callable[..., Any]) -> Callable[[list[Any], dict[str, Any]], Any]:
    return lambda args, kwargs: fn(*args, **kwargs)


@functools.cache
def warm_up() -> None:
    """Start, outside the cap, what a call may start for the first time: the CUDA backend and
    its first context take more memory than MEMORY_HEADROOM, and a backend that fails to start
    stays unavailable for the rest of the session."""
    if ais.is_available("cuda") and ais.device_count("cuda"):
        ais.Stream("cuda:0")


@contextlib.contextmanager
def memory_cap() -> Iterator[None]:
    """Cap the process's data memory at MEMORY_HEADROOM more than it holds (Linux)."""
    warm_up()
    try:
        with open("/proc/self/status") as f:
            held = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    except (OSError, StopIteration):  # no /proc: no cap
        held = None
    if held is None or resource is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = held + MEMORY_HEADROOM
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def wait(awaitable: Any) -> None:
    """Await on asyncio, for at most ASYNC_TIMEOUT seconds."""

    async def main() -> None:
        with anyio.move_on_after(ASYNC_TIMEOUT) as scope:
            await awaitable
        if scope.cancelled_caught:
            raise Hang(f"still awaiting after {ASYNC_TIMEOUT} s")

    anyio.run(main, backend="asyncio")


async def _use_async(result: Any) -> None:
    cm = contextlib.AsyncExitStack()
    async with cm:
        if hasattr(type(result), "__aenter__"):
            await cm.enter_async_context(result)
        if hasattr(type(result), "__aiter__"):
            async for _ in result:
                break


def _use(result: Any) -> None:
    """Use what a call returned as users would: show it, enter it, iterate it once."""
    repr(result)
    str(result)
    kind = type(result)
    if hasattr(kind, "__enter__") and hasattr(kind, "__exit__"):
        with result:
            pass
    elif hasattr(kind, "__aenter__") or hasattr(kind, "__aiter__"):
        wait(_use_async(result))


@dataclass(frozen=True)
class Problem:
    """A call that raised an undocumented error, or hung."""

    call: str
    error: str
    """The exception's type, or ``"hang"``."""
    where: str
    """The last frame: where it was raised."""
    text: str


@contextlib.contextmanager
def _unraisable() -> Iterator[list[str]]:
    """What nothing could raise meanwhile (a coroutine never awaited, an error in ``__del__``):
    collected here, so that it is told with the call that left it."""
    found: list[str] = []

    def hook(u: Any) -> None:
        found.append(f"{type(u.exc_value).__name__}: {u.exc_value}")

    previous, sys.unraisablehook = sys.unraisablehook, hook
    try:
        yield found
    finally:
        gc.collect(1)  # the young cycles the call left (the old ones are pytest's to see)
        sys.unraisablehook = previous


def _show(value: Any) -> str:
    """A value as the call's text shows it: the test's callables by name."""
    if inspect.isfunction(value) and value.__module__ == __name__:
        return value.__qualname__
    return repr(value)


def attempt(target: Target, args: list[Any], kwargs: dict[str, Any]) -> Problem | None:
    """Call ``target`` as a user would, in a thread of its own; return what went wrong."""
    outcome: dict[str, BaseException] = {}

    def work() -> None:
        try:
            result = target.invoke(
                [resolve(a) for a in args], {k: resolve(v) for k, v in kwargs.items()}
            )
            if inspect.isawaitable(result):
                wait(result)
            elif target.use_result:
                _use(result)
            if target.then is not None:
                target.then()
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome["raised"] = exc

    listed = [_show(a) for a in args] + [f"{k}={_show(v)}" for k, v in kwargs.items()]
    call = f"{target.name}({', '.join(listed)})"
    if target.on:
        call += f" on {target.on}"
    if target.then is not None:
        call += f", then {target.then.__name__}()"
    with _unraisable() as unraisable:
        with memory_cap():
            thread = threading.Thread(target=work, name=f"fuzz {target.key}", daemon=True)
            thread.start()
            thread.join(CALL_TIMEOUT)
        if thread.is_alive():
            return Problem(call, "hang", "", f"{call} hung: still running after {CALL_TIMEOUT} s")
        problem = _judge(target, call, outcome.pop("raised", None))  # and drop it: what it
    if unraisable:  # held (its frames) is freed, and told here
        return Problem(
            call,
            "unraisable",
            unraisable[0],
            f"{call}\nleft an exception nothing could raise: {unraisable[0]}",
        )
    return problem


def _judge(target: Target, call: str, raised: BaseException | None) -> Problem | None:
    if isinstance(raised, Hang):
        return Problem(call, "hang", "", f"{call} hung: {raised}")
    if raised is None or isinstance(raised, target.documented + (Raised,)):
        return None
    tb = traceback.extract_tb(raised.__traceback__)
    where = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    frames = "".join(traceback.format_exception(raised)[-7:])
    error = type(raised).__name__
    return Problem(call, error, where, f"{call}\nraised {error}: {raised}\n{frames}")


#: profiles entered and not left by the code that made them (a factory's running profile)
_ENTERED: list[ais.Profiler] = []


def running_profile(device: str) -> ais.Profiler:
    """A profile of ``device``, entered and never left: :func:`reset_globals` ends it."""
    prof = ais.profile(device)
    prof.__enter__()
    _ENTERED.append(prof)
    return prof


def reset_globals() -> None:
    """A fresh simulator for the next example (injected faults gone), the settings back, and
    no profile running: those :func:`running_profile` made are ended (a call may have ended
    one already, or may have failed to end it); another left running fails the test, since
    every later example would meet it."""
    while _ENTERED:
        with contextlib.suppress(ais.AiostreamError):  # ended already, or stale since a reset
            _ENTERED.pop().__exit__(None, None, None)
    ais.virtual.reset()
    ais.set_wait_strategy(None)
    ais.set_debug(False)
    ais.set_watchdog(None)
    try:
        with ais.profile("virtual:0"):
            pass
    except ais.AiostreamError as exc:
        raise AssertionError(f"a profile was left running by the last call: {exc}") from None
