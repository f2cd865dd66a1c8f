"""The instrumentation slots, at the ground floor of the package: the modules that wait, copy
and launch call them; an observer (the profiler) and NVTX plug into them. This module imports
nothing from the package, so every layer may call it.

While nothing is plugged in, a call costs one global check. An observer's own error is logged
on the ``aiostream`` logger and never replaces the user's exception or result: instrumentation
must not change what a program does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = [
    "Observer",
    "device_range",
    "enable_nvtx",
    "failed",
    "install",
    "now",
    "on_await",
    "uninstall",
]

_log = logging.getLogger("aiostream")


class Observer(Protocol):
    """What is told about awaits and device work (``aiostream.profiler.Profiler`` is one).

    Streams are passed as they are (``aiostream.Stream``); this module does not know their type.
    """

    def now(self) -> float: ...

    def on_await(self, task: str, subject: str, device: str, start: float, end: float) -> None:
        """An await on ``subject`` by ``task`` ran from ``start`` to ``end``."""

    def native_timeline(self, stream: Any) -> bool:
        """Whether ``stream``'s backend shows its work itself (no timing events needed)."""

    def mark(self, stream: Any) -> Any:
        """Something recorded on ``stream`` now, that times a range's end points."""

    def add_device_range(
        self, name: str, stream: Any, start: Any, end: Any, args: dict[str, Any], *, op: bool
    ) -> None:
        """Work submitted to ``stream`` between the marks ``start`` and ``end``."""


#: The installed observer, or None: the fast paths check only this.
observer: Observer | None = None
#: The ``nvtx`` module once a CUDA backend is in use and the package is installed, or None.
nvtx: Any = None

_NOTHING = contextlib.nullcontext()


def install(obs: Observer) -> None:
    """Plug ``obs`` in (one at a time; the caller checks)."""
    global observer
    observer = obs


def uninstall(obs: Observer) -> None:
    """Unplug ``obs`` if it is the one plugged in."""
    global observer
    if observer is obs:
        observer = None


def enable_nvtx() -> None:
    """Emit NVTX ranges from ``record_function`` from now on, if ``nvtx`` is installed (the
    CUDA backend calls it: NVTX is how CUDA's own profilers see ranges)."""
    global nvtx
    try:
        import nvtx as module
    except ImportError:
        return
    nvtx = module


def failed(obs: object, what: str) -> None:
    """Log that ``obs`` raised in ``what`` (call it from an ``except`` block)."""
    _log.exception("aiostream: the observer %r failed in %s; the program goes on", obs, what)


def now(obs: Observer) -> float:
    """``obs.now()``, or 0.0 if it failed (logged)."""
    try:
        return obs.now()
    except Exception:
        failed(obs, "now()")
        return 0.0


def on_await(obs: Observer, task: str, subject: str, device: str, start: float) -> None:
    """Tell ``obs`` that an await which began at ``start`` ends now; its error is logged."""
    try:
        obs.on_await(task, subject, device, start, obs.now())
    except Exception:
        failed(obs, "on_await()")


def device_range(name: str, stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Bracket work submitted to ``stream`` with the observer's marks, for backends whose own
    timeline does not already show it. Free while nothing is plugged in."""
    obs = observer
    if obs is None:
        return _NOTHING
    try:
        if obs.native_timeline(stream):
            return _NOTHING
    except Exception:
        failed(obs, "native_timeline()")
        return _NOTHING
    return _range(obs, name, stream)


@contextlib.contextmanager
def _range(obs: Observer, name: str, stream: Any) -> Iterator[None]:
    try:
        start = obs.mark(stream)
    except Exception:
        failed(obs, "mark()")
        yield
        return
    try:
        yield
    finally:
        try:
            obs.add_device_range(name, stream, start, obs.mark(stream), {}, op=True)
        except Exception:
            failed(obs, "add_device_range()")
