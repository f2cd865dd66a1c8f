"""``record_function``: a named range of a program, told to the listeners plugged into
``_hooks`` (a profile's host span and device range, tracing's spans) and to NVTX. It sits in
the core, beside the streams it brackets, so that what the core runs (a graph's capture and
replays) can name its ranges without importing the listeners.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from . import _hooks
from .stream import Stream

__all__ = ["NVTX_DOMAIN", "record_function"]

F = TypeVar("F", bound=Callable[..., Any])


#: the NVTX domain of record_function's ranges (Nsight Systems groups them under it)
NVTX_DOMAIN = "aiostream"


class _Entry:
    """One entry into a record_function: what its exit ends (each task's its own)."""

    __slots__ = ("range", "ranged", "told")

    def __init__(self) -> None:
        self.told: list[tuple[_hooks.Listener, Any]] = []  # the listeners' tokens
        self.range: Any = None
        self.ranged = False  # an NVTX range was started (its id may be anything)


#: per context (a task, a thread), the entries of each record_function not yet left there,
#: newest last; never changed in place, so that a task's copy of its parent's context does not
#: see the parent's later entries
_entries: contextvars.ContextVar[dict[record_function, tuple[_Entry, ...]]] = (
    contextvars.ContextVar("aiostream_record_function_entries", default={})  # noqa: B039
)


class record_function:  # named as torch.profiler.record_function
    """A named range: ``with``, ``async with``, or a decorator of sync and async functions.

    While a profiler is active it records a host span tagged with the task's name and, with
    ``stream=``, a device range bracketing the work submitted to that stream inside it
    (``aiostream.tracing`` makes spans of it likewise). With nothing listening it costs about
    what ``contextlib.nullcontext()`` does. On CUDA, where the
    ``nvtx`` package is installed (the ``nvtx`` extra), it is also an NVTX range in the
    ``aiostream`` domain, so Nsight Systems shows it: a start/end range, not a push/pop one,
    since tasks on one loop thread enter and leave their ranges interleaved across awaits
    (a thread's push/pop stack would end one task's range at another's exit).

    Args:
        name: the range's name.
        stream: also time the device work submitted to this stream inside the range.
        **args: extra values shown with the span in traces.
    """

    __slots__ = ("_open", "args", "name", "stream")

    def __init__(self, name: str, *, stream: Stream | None = None, **args: Any) -> None:
        if type(name) is not str:
            raise TypeError(f"name must be a str, got {name!r}")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be an aiostream.Stream or None, got {stream!r}")
        self.name = name
        self.stream = stream
        self.args = args
        #: the entries not yet left, in every context (one left elsewhere than it was entered
        #: is ended from here)
        self._open: list[_Entry] = []

    def __enter__(self) -> record_function:
        if not _hooks.listeners and _hooks.nvtx is None:
            return self  # the cost with nothing listening: this check, and the one in __exit__
        entry = _Entry()
        if _hooks.listeners:  # each listener's failure is logged, never the user's
            entry.told = _hooks.region_began(self.name, self.stream, self.args)
        if _hooks.nvtx is not None:
            try:
                entry.range = _hooks.nvtx.start_range(message=self.name, domain=NVTX_DOMAIN)
                entry.ranged = True
            except Exception:  # NVTX's failure never becomes the user's
                _hooks.nvtx_failed("start_range")
        entries = _entries.get()
        _entries.set({**entries, self: (*entries.get(self, ()), entry)})
        self._open.append(entry)
        return self

    def _left(self) -> _Entry | None:
        """The entry this exit ends: this context's newest, else (entered in another
        context) the oldest open; None if none is open."""
        entries = _entries.get()
        stack = entries.get(self)
        if stack:
            entry = stack[-1]
            rest = dict(entries)
            if len(stack) > 1:
                rest[self] = stack[:-1]
            else:
                del rest[self]
            _entries.set(rest)
            for i, e in enumerate(self._open):
                if e is entry:
                    del self._open[i]
                    break
            return entry
        try:
            return self._open.pop(0)
        except IndexError:
            return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._open:
            return  # the cost with nothing listening: nothing was entered with a listener
        entry = self._left()
        if entry is None:
            return
        if _hooks.nvtx is not None and entry.ranged:  # not if NVTX began inside
            try:
                _hooks.nvtx.end_range(entry.range)
            except Exception:  # nor replaces the user's exception or result
                _hooks.nvtx_failed("end_range")
        if entry.told:  # the listeners told at the entry (none if they began inside)
            _hooks.region_ended(entry.told)

    async def __aenter__(self) -> record_function:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"record_function decorates a function, got {fn!r}")
        name, stream, args = self.name, self.stream, self.args
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*a: Any, **k: Any) -> Any:
                if not _hooks.listeners and _hooks.nvtx is None:
                    return await fn(*a, **k)
                with record_function(name, stream=stream, **args):
                    return await fn(*a, **k)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            if not _hooks.listeners and _hooks.nvtx is None:
                return fn(*a, **k)
            with record_function(name, stream=stream, **args):
                return fn(*a, **k)

        return wrapper  # type: ignore[return-value]
