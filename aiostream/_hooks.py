"""The instrumentation seam, at the ground floor of the package: the modules that wait, submit,
copy and mark regions call it, and listeners plug into it, each a :class:`Listener` (the
profiler, OpenTelemetry tracing, Prometheus metrics). NVTX has a slot of its own, which the
CUDA backend fills. This module imports nothing from the package, so every layer may call it.

While nothing listens, a call costs one global check (``listeners``). A listener's own error
is logged on the ``aiostream`` logger, once per listener and hook, and never replaces the
user's exception or result: instrumentation must not change what a program does.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

__all__ = [
    "Listener",
    "add_listener",
    "copied",
    "enable_nvtx",
    "failed",
    "held",
    "listeners",
    "loader_batch",
    "nvtx_failed",
    "region_began",
    "region_ended",
    "remove_listener",
    "submit_began",
    "submit_ended",
    "wait_began",
    "wait_ended",
    "wanted",
]

_log = logging.getLogger("aiostream")


class Listener:
    """Told what aiostream does while it is plugged in (:func:`add_listener`).

    Every hook is a no-op here: a listener overrides those it needs, and only those are called.
    The hooks' names are private, so that they stay off the public face of the objects that
    listen (``aiostream.Profiler``, ``aiostream.tracing.Tracing``,
    ``aiostream.metrics.PrometheusMetrics``). Streams and events are passed as they are; this
    module does not know their types. What a ``..._began`` hook returns (its token) is handed
    to the matching ``..._ended`` hook, every time, even once the listener is unplugged.
    """

    def _wait_began(self, subject: str, device: str, strategy: str) -> Any:
        """A task began to wait on ``subject`` (called in the waiting task; ``strategy`` is
        ``complete`` where the work had completed: the wait is one checkpoint)."""

    def _wait_ended(self, token: Any, error: BaseException | None, outcome: str) -> None:
        """That wait ended with ``error`` (None: it completed); ``outcome`` says how:
        ``completed``, ``failed`` (a ``DeviceError``), ``cancelled`` or ``error``."""

    def _submit_began(self, name: str, stream: Any) -> Any:
        """The op ``name`` is being submitted to ``stream``, now: what is recorded on the
        stream here comes right before it (called in the submitting thread, never while the
        stream captures a graph)."""

    def _submit_ended(self, token: Any) -> None:
        """That op was submitted (or refused): what is recorded on the stream here comes right
        after it."""

    def _region_began(self, name: str, stream: Any, args: dict[str, Any]) -> Any:
        """A ``record_function`` region ``name`` was entered (``stream``: the stream whose
        work it brackets, or None; ``args``: its extra values)."""

    def _region_ended(self, token: Any) -> None:
        """That region was left."""

    def _copied(self, device: str, kind: str, nbytes: int) -> None:
        """A copy of ``nbytes`` was submitted (``kind``: ``h2d``, ``d2h`` or ``d2d``)."""

    def _loader_batch(self, device: str, waited: float) -> None:
        """A data loader handed a batch out, after its consumer waited ``waited`` seconds."""

    def _holds(self) -> list[Any]:
        """The device objects (streams, events) this listener keeps for itself while it
        listens: no leak of the program's (the pytest plugin leaves them out of its listing)."""
        return []

    def _failed(self, what: str) -> None:
        """Log, once for this listener, that it failed in ``what`` (call it from an
        ``except`` block)."""
        failed(self, what)


#: The listeners plugged in: a tuple, replaced whole, so a reader never sees one half-added.
#: The fast paths check only this.
listeners: tuple[Listener, ...] = ()
#: The ``nvtx`` module once a CUDA backend is in use and the package is installed, or None.
nvtx: Any = None

#: each kind of call, and the hooks of it that a listener may override
_KINDS = {
    "wait": ("_wait_began", "_wait_ended"),
    "submit": ("_submit_began", "_submit_ended"),
    "region": ("_region_began", "_region_ended"),
    "copied": ("_copied",),
    "loader_batch": ("_loader_batch",),
}
#: per kind of call, the listeners that override one of its hooks: the others are not called
_told: dict[str, tuple[Listener, ...]] = dict.fromkeys(_KINDS, ())
_plugging = threading.Lock()
#: what each listener failed in, said once
_said: weakref.WeakKeyDictionary[Listener, set[str]] = weakref.WeakKeyDictionary()
_nvtx_said: set[tuple[int, str]] = set()  # (id of the nvtx module, what it failed in)


def _overrides(listener: Listener, hooks: tuple[str, ...]) -> bool:
    """Whether ``listener`` has its own version of one of ``hooks`` (its class's, or its own)."""
    for hook in hooks:
        mine = getattr(listener, hook)
        if getattr(mine, "__func__", None) is not getattr(Listener, hook):
            return True
    return False


def wanted(kind: str) -> bool:
    """Whether a listener plugged in wants ``kind`` of call (``"submit"``, ``"region"``,
    ...): a caller with work to do before telling (a timing event) checks it first."""
    return bool(_told[kind])


def _plug(plugged: tuple[Listener, ...]) -> None:
    global listeners, _told
    _told = {
        kind: tuple(x for x in plugged if _overrides(x, hooks)) for kind, hooks in _KINDS.items()
    }
    listeners = plugged


def add_listener(listener: Listener) -> None:
    """Plug ``listener`` in (once: a second add does nothing)."""
    with _plugging:
        if listener not in listeners:
            _plug((*listeners, listener))


def remove_listener(listener: Listener) -> None:
    """Unplug ``listener``; the tokens it handed out are still handed back to it."""
    with _plugging:
        _plug(tuple(x for x in listeners if x is not listener))


def held() -> list[Any]:
    """The device objects that the listeners plugged in keep for themselves (see
    :meth:`Listener._holds`)."""
    objects: list[Any] = []
    for listener in listeners:
        try:
            objects += listener._holds()  # noqa: SLF001 - the hook this module defines
        except Exception:
            failed(listener, "holds()")
    return objects


def failed(listener: Listener, what: str) -> None:
    """Log, once per ``listener`` and ``what``, that it raised in ``what`` (call it from an
    ``except`` block): the program goes on."""
    said = _said.setdefault(listener, set())
    if what in said:
        return
    said.add(what)
    _log.exception(
        "aiostream: the listener %r failed in %s (said once); the program goes on", listener, what
    )


def _began(kind: str, hook: str, *args: Any) -> list[tuple[Listener, Any]]:
    """Call ``hook`` of each listener of ``kind``: the tokens, for :func:`_ended`."""
    tokens = []
    for listener in _told[kind]:
        try:
            tokens.append((listener, getattr(listener, hook)(*args)))
        except Exception:
            failed(listener, f"{hook[1:]}()")
    return tokens


def _ended(hook: str, tokens: list[tuple[Listener, Any]], *args: Any) -> None:
    for listener, token in tokens:
        try:
            getattr(listener, hook)(token, *args)
        except Exception:
            failed(listener, f"{hook[1:]}()")


def wait_began(subject: str, device: str, strategy: str) -> list[tuple[Listener, Any]]:
    """Tell the listeners a wait began, in the waiting task; the tokens for
    :func:`wait_ended` (empty: nobody was told)."""
    return _began("wait", "_wait_began", subject, device, strategy)


def wait_ended(
    tokens: list[tuple[Listener, Any]], error: BaseException | None, outcome: str
) -> None:
    _ended("_wait_ended", tokens, error, outcome)


def submit_began(name: str, stream: Any) -> list[tuple[Listener, Any]]:
    """Tell the listeners that the op ``name`` is being submitted to ``stream``: call it right
    before the submission, and :func:`submit_ended` right after, in the same thread."""
    return _began("submit", "_submit_began", name, stream)


def submit_ended(tokens: list[tuple[Listener, Any]]) -> None:
    _ended("_submit_ended", tokens)


def region_began(name: str, stream: Any, args: dict[str, Any]) -> list[tuple[Listener, Any]]:
    return _began("region", "_region_began", name, stream, args)


def region_ended(tokens: list[tuple[Listener, Any]]) -> None:
    _ended("_region_ended", tokens)


def copied(device: str, kind: str, nbytes: int) -> None:
    for listener in _told["copied"]:
        try:
            listener._copied(device, kind, nbytes)  # noqa: SLF001 - the hook this module defines
        except Exception:
            failed(listener, "copied()")


def loader_batch(device: str, waited: float) -> None:
    for listener in _told["loader_batch"]:
        try:
            listener._loader_batch(device, waited)  # noqa: SLF001 - the hook this module defines
        except Exception:
            failed(listener, "loader_batch()")


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
    if key in _nvtx_said:
        return
    _nvtx_said.add(key)
    _log.exception("aiostream: nvtx failed in %s (said once); the program goes on", what)
