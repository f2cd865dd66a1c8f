"""The instrumentation slots, at the ground floor of the package: the modules that wait, copy
and launch call them; an observer (the profiler), NVTX and telemetry listeners (OpenTelemetry,
Prometheus) plug into them. This module imports nothing from the package, so every layer may
call it.

While nothing is plugged in, a call costs one global check. An observer's or listener's own
error is logged on the ``aiostream`` logger (a listener's once per hook) and never replaces the
user's exception or result: instrumentation must not change what a program does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = [
    "Listener",
    "Observer",
    "add_listener",
    "copied",
    "device_range",
    "enable_nvtx",
    "nvtx_failed",
    "failed",
    "install",
    "listeners",
    "loader_batch",
    "now",
    "on_await",
    "region",
    "remove_listener",
    "uninstall",
    "wait_began",
    "wait_ended",
]

_log = logging.getLogger("aiostream")


class Observer(Protocol):
    """What is told about awaits and device work (``aiostream.observe.profiler.Profiler`` is one).

    Streams are passed as they are (``aiostream.Stream``); this module does not know their type.
    """

    def now(self) -> float: ...

    def on_await(self, task: str, subject: str, device: str, start: float, end: float) -> None:
        """An await on ``subject`` by ``task`` ran from ``start`` to ``end``."""

    def native_timeline(self, stream: Any) -> bool:
        """Whether ``stream``'s backend shows its work itself (no timing events needed)."""

    def add_host(
        self, name: str, task: str, start: float, end: float, args: dict[str, Any]
    ) -> None:
        """A host range ``name`` of ``task`` (``record_function``) ran from ``start`` to
        ``end``."""

    def mark(self, stream: Any) -> Any:
        """Something recorded on ``stream`` now, that times a range's end points."""

    def add_device_range(
        self,
        name: str,
        stream: Any,
        start: Any,
        end: Any,
        args: dict[str, Any],
        *,
        op: bool = False,
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


class Listener(Protocol):
    """Told of waits, copies and loader batches as they happen (``aiostream.tracing`` and
    ``aiostream.metrics`` are listeners). Any number may listen."""

    def wait_began(self, subject: str, device: str, strategy: str) -> object:
        """A task began to wait on ``subject``; what it returns comes back to ``wait_ended``."""

    def wait_ended(self, token: object, error: BaseException | None, outcome: str) -> None:
        """That wait ended with ``error`` (None: it completed); ``outcome`` says how:
        ``completed``, ``failed`` (a ``DeviceError``), ``cancelled`` or ``error``."""

    def copied(self, device: str, kind: str, nbytes: int) -> None:
        """A copy of ``nbytes`` was submitted (``kind``: ``h2d``, ``d2h`` or ``d2d``)."""

    def loader_batch(self, device: str, waited: float) -> None:
        """A data loader handed a batch out, after its consumer waited ``waited`` seconds."""

    def region(
        self, name: str, stream: Any, start: Any, end: Any, host: tuple[float, float]
    ) -> None:
        """A ``record_function`` region on ``stream``, between timing events ``start`` and
        ``end`` (None where the stream has no timing: host times only), over ``host``
        (monotonic seconds)."""


#: The listeners plugged in: a tuple, replaced whole, so a reader never sees one half-added.
listeners: tuple[Listener, ...] = ()
_failed_once: set[tuple[int, str]] = set()


def add_listener(listener: Listener) -> None:
    global listeners
    if listener not in listeners:
        listeners = (*listeners, listener)


def remove_listener(listener: Listener) -> None:
    global listeners
    listeners = tuple(x for x in listeners if x is not listener)
    _failed_once.difference_update({k for k in _failed_once if k[0] == id(listener)})


class Listening:
    """A public object that listens until it is closed (``aiostream.tracing.Tracing``,
    ``aiostream.metrics.PrometheusMetrics``): its hooks are its private methods
    (``_wait_began``, ``_wait_ended``, ``_copied``, ``_loader_batch``, ``_region``), plugged
    in through an adapter so that they stay off its public face."""

    closed = True

    def _listen(self) -> None:
        self.closed = False
        self._adapter = _Adapter(self)
        add_listener(self._adapter)

    def close(self) -> None:
        """Stop listening (a second close does nothing)."""
        if self.closed:
            return
        self.closed = True
        remove_listener(self._adapter)
        self._stopped()

    def _stopped(self) -> None:
        """What a subclass lets go of once closed."""

    def _holds(self) -> list[Any]:
        """The device objects (streams, events) a subclass keeps for itself while it listens:
        no leak of the program's (the pytest plugin leaves them out of its listing)."""
        return []

    def _failed(self, what: str) -> None:
        """Log, once, that this listener failed in ``what``."""
        _listener_failed(self._adapter, what)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = type(self)
        return f"<{kind.__module__}.{kind.__qualname__} {'closed' if self.closed else 'on'}>"


class _Adapter:
    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.wait_began = owner._wait_began  # noqa: SLF001 - the owner's hooks
        self.wait_ended = owner._wait_ended  # noqa: SLF001 - the owner's hooks
        self.copied = owner._copied  # noqa: SLF001 - the owner's hooks
        self.loader_batch = owner._loader_batch  # noqa: SLF001 - the owner's hooks
        self.region = owner._region  # noqa: SLF001 - the owner's hooks

    def __repr__(self) -> str:
        return repr(self.owner)


def held() -> list[Any]:
    """The device objects that the listeners plugged in keep for themselves (see
    :meth:`Listening._holds`)."""
    objects: list[Any] = []
    for listener in listeners:
        owner = getattr(listener, "owner", None)
        if isinstance(owner, Listening):
            objects += owner._holds()  # noqa: SLF001 - the owner's own
    return objects


def _listener_failed(listener: object, what: str) -> None:
    key = (id(listener), what)
    if key in _failed_once:
        return
    _failed_once.add(key)
    _log.exception(
        "aiostream: the listener %r failed in %s (said once); the program goes on", listener, what
    )


def wait_began(subject: str, device: str, strategy: str) -> list[tuple[Listener, object]]:
    """Tell every listener a wait began; the tokens to hand to :func:`wait_ended`."""
    tokens = []
    for listener in listeners:
        try:
            tokens.append((listener, listener.wait_began(subject, device, strategy)))
        except Exception:
            _listener_failed(listener, "wait_began()")
    return tokens


def wait_ended(
    tokens: list[tuple[Listener, object]], error: BaseException | None, outcome: str
) -> None:
    for listener, token in tokens:
        try:
            listener.wait_ended(token, error, outcome)
        except Exception:
            _listener_failed(listener, "wait_ended()")


def _tell(hook: str, *args: Any) -> None:
    """Call ``hook`` of every listener with ``args``; each one's error is logged once."""
    for listener in listeners:
        try:
            getattr(listener, hook)(*args)
        except Exception:
            _listener_failed(listener, f"{hook}()")


def copied(device: str, kind: str, nbytes: int) -> None:
    _tell("copied", device, kind, nbytes)


def loader_batch(device: str, waited: float) -> None:
    _tell("loader_batch", device, waited)


def region(name: str, stream: Any, start: Any, end: Any, host: tuple[float, float]) -> None:
    _tell("region", name, stream, start, end, host)


def enable_nvtx() -> None:
    """Emit NVTX ranges from ``record_function`` from now on, if ``nvtx`` is installed (the
    CUDA backend calls it: NVTX is how CUDA's own profilers see ranges)."""
    global nvtx
    try:
        import nvtx as module
    except ImportError:
        return
    nvtx = module


def nvtx_failed(what: str) -> None:
    """Log, once per ``what``, that the ``nvtx`` package raised (call it from an ``except``
    block): instrumentation never changes what a program does."""
    key = (id(nvtx), what)
    if key in _failed_once:
        return
    _failed_once.add(key)
    _log.exception("aiostream: nvtx failed in %s (said once); the program goes on", what)


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
