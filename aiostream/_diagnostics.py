"""Diagnostics: pending waits, where they started and where their work was recorded, watchdog.

Tracebacks are captured only in debug mode (``aiostream.set_debug(True)`` or
``AIOSTREAM_DEBUG=1``), and cheaply: a capture walks up to a dozen frames and keeps
(file, line, function) triples, formatted only when someone looks.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from . import _check

__all__ = [
    "PendingWait",
    "capture",
    "pending_waits",
    "set_debug",
    "set_watchdog",
]

logger = logging.getLogger("aiostream")

Origin = tuple[tuple[str, int, str], ...]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _library_dirs() -> tuple[tuple[str, ...], frozenset[str]]:
    """Where the event loops' and their helpers' code lives: frames there are machinery
    (asyncio's task steps, anyio's task groups, trio's runner), not the user's code. Found by
    name, without importing any of them: (the folders, each ending with a separator so that
    a user's ``aiostream_demo.py`` beside the package is not taken for it; the files of the
    single modules)."""
    dirs = [_PACKAGE_DIR]
    for name in ("asyncio", "anyio", "trio", "sniffio", "uvloop", "concurrent", "outcome"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.abspath(d) for d in spec.submodule_search_locations)
    files = []
    for name in ("contextlib", "threading", "runpy"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            files.append(os.path.abspath(spec.origin))
    return tuple(os.path.join(d, "") for d in dirs), frozenset(files)


#: what a capture leaves out: aiostream itself and the loops' machinery (found at the first
#: capture, debug mode's: the search costs milliseconds that ``import aiostream`` need not)
_skipped: tuple[tuple[str, ...], frozenset[str]] | None = None
#: debug captures on (``set_debug``, ``AIOSTREAM_DEBUG=1``); hot paths read it as a global
debug = os.environ.get("AIOSTREAM_DEBUG", "") not in ("", "0")
_watchdog: float | None = None
_lock = threading.Lock()
_pending: dict[Record, None] = {}  # in the order the waits began


def set_debug(enabled: bool) -> None:
    """Capture where waits start and where awaited work was recorded (a little slower)."""
    global debug
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    debug = enabled


def set_watchdog(seconds: float | None) -> None:
    """Warn on the ``aiostream`` logger, with the pending-wait listing, for any wait longer
    than ``seconds`` (once per wait). None turns the watchdog off (the default).
    """
    global _watchdog
    if seconds is not None:
        seconds = _check.seconds(seconds, "seconds", positive=True, what="a number or None")
    _watchdog = seconds


def watchdog_threshold() -> float | None:
    return _watchdog


def capture(skip: int = 1) -> Origin | None:
    """The caller's own frames (innermost last), if debug mode is on: neither aiostream's nor
    the event loops' machinery (asyncio, anyio, trio), so a listing shows the user's code."""
    if not debug:
        return None
    global _skipped
    if _skipped is None:
        _skipped = _library_dirs()
    folders, files = _skipped
    frame: FrameType | None = sys._getframe(skip + 1)  # noqa: SLF001 (the stdlib's API)
    frames: list[tuple[str, int, str]] = []
    while frame is not None and len(frames) < 12:
        code = frame.f_code
        name = code.co_filename
        if not (name.startswith(folders) or name in files or name.startswith("<")):
            frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(reversed(frames))


def format_origin(origin: Origin | None) -> str | None:
    if origin is None:
        return None
    return "".join(f'    File "{f}", line {n}, in {name}\n' for f, n, name in origin)


@dataclass(frozen=True)
class PendingWait:
    """One wait in progress, as :func:`pending_waits` reports it."""

    task: str
    """The waiting task's name."""
    subject: str
    """What it waits on: the event or stream."""
    device: str
    waited: float
    """Seconds since the wait started (monotonic clock)."""
    started_at: str | None
    """Where the wait started (debug mode only)."""
    recorded_at: str | None
    """Where the awaited work was recorded or last submitted (debug mode only)."""
    strategy: str = ""
    """How the wait is watched (``"hybrid"``, ``"thread"``, ...; "" for a blocking wait)."""

    def __post_init__(self) -> None:
        for name in ("task", "subject", "device"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")
        if isinstance(self.waited, bool) or not isinstance(self.waited, (int, float)):
            raise TypeError(f"waited must be a number of seconds, got {self.waited!r}")
        for name in ("started_at", "recorded_at"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str or None, got {getattr(self, name)!r}")

    def __str__(self) -> str:
        lines = [
            f"task {self.task!r} has waited {self.waited:.3f} s on {self.subject} ({self.device})"
        ]
        for title, where in (
            ("wait started at", self.started_at),
            ("work recorded at", self.recorded_at),
        ):
            if where:
                lines.append(f"  {title}:\n{where.rstrip()}")
        if self.started_at is None and self.recorded_at is None:
            lines.append("  (aiostream.set_debug(True) or AIOSTREAM_DEBUG=1 shows where)")
        return "\n".join(lines)


class Owner(Protocol):
    """What keeps a wait on an event loop (``_waiting``'s waiter)."""

    def gone(self) -> bool:
        """Whether its event loop closed with the wait pending."""

    def forsake(self) -> None:
        """Forget every wait of that loop."""


class Record:
    """A wait in progress; the task's name is read only when someone looks."""

    __slots__ = (
        "about",
        "describe",
        "device",
        "name_of",
        "origin",
        "owner",
        "recorded",
        "start",
        "strategy",
        "task_ref",
        "warned",
    )

    def __init__(
        self,
        task: object,
        name_of: Callable[[object], str],
        subject: object,
        device: str,
        origin: Origin | None,
        recorded: Origin | None,
        owner: Owner | None = None,
        strategy: str = "",
        describe: Callable[[Any], str] | None = None,
    ) -> None:
        self.owner = owner
        self.strategy = strategy
        self.task_ref = task
        self.name_of = name_of
        #: what is awaited: its words, or the object ``describe`` words when someone looks
        #: (no string per wait)
        self.about = subject
        self.describe = describe
        self.device = device
        self.origin = origin
        self.recorded = recorded
        self.start = time.monotonic()
        self.warned = False

    @property
    def task(self) -> str:
        return self.name_of(self.task_ref)

    @property
    def subject(self) -> str:
        describe = self.describe
        return str(self.about) if describe is None else describe(self.about)

    def report(self, now: float) -> PendingWait:
        return PendingWait(
            task=self.task,
            subject=self.subject,
            device=self.device,
            waited=now - self.start,
            started_at=format_origin(self.origin),
            recorded_at=format_origin(self.recorded),
            strategy=self.strategy,
        )


def register(record: Record) -> None:
    with _lock:
        _pending[record] = None


def unregister(record: Record) -> None:
    with _lock:
        _pending.pop(record, None)


def pending_waits() -> list[PendingWait]:
    """Every wait in progress, in any thread or loop, longest first. The waits of a loop
    closed with them pending are forgotten (``Owner.forsake``), not listed."""
    now = time.monotonic()
    with _lock:
        records = list(_pending)
    gone = {id(r.owner): r.owner for r in records if r.owner is not None and r.owner.gone()}
    for owner in gone.values():
        owner.forsake()
    live = [r for r in records if id(r.owner) not in gone]
    return sorted((r.report(now) for r in live), key=lambda w: -w.waited)


def warn_late(late: list[Record]) -> None:
    """Warn once, with the pending-wait listing, about ``late``: waits the caller (a waiter,
    on its loop's clock) found pending past the watchdog's threshold."""
    threshold = _watchdog
    late = [r for r in late if not r.warned]
    if threshold is None or not late:
        return
    for r in late:
        r.warned = True
    listing = "\n".join(str(w) for w in pending_waits())
    logger.warning("%d wait(s) pending for more than %.3g s:\n%s", len(late), threshold, listing)
