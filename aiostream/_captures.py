"""The graph captures aiostream has under way, as the user objects see them.

Two things hang on them. The buffers a capture's copies use must outlive every replay: each
capture keeps, until its graph is closed, the buffers of the copies submitted to a capturing
stream of its device (a copy on a stream forked into it included). And, as the driver
prohibits on the thread of a capture begun in ``"global"`` or ``"thread_local"`` mode, memory
is not allocated on that thread while the capture is under way, nor on a capturing stream in
any mode (the allocation would become part of the graph): refused before the driver is asked,
with the same words on every backend.
"""

from __future__ import annotations

import threading

from ._errors import CaptureError, capture_allocation

__all__ = ["begin", "check_allocation", "end", "keep", "under_way"]

#: per device (kind, index): the keep-lists of the captures under way there
_keeping: dict[tuple[str, int], list[list[object]]] = {}
_lock = threading.Lock()
#: per thread: the modes of the captures begun on it and under way ("relaxed" ones included)
_here = threading.local()


def begin(device: tuple[str, int], mode: str) -> list[object]:
    """A capture begins on this thread, on ``device``: the list its buffers are kept in."""
    kept: list[object] = []
    with _lock:
        _keeping.setdefault(device, []).append(kept)
    modes: list[str] = _here.__dict__.setdefault("modes", [])
    modes.append(mode)
    return kept


def end(device: tuple[str, int], mode: str, kept: list[object]) -> None:
    """The capture that :func:`begin` returned ``kept`` for ended (on its thread)."""
    with _lock:
        lists = _keeping[device]
        lists.remove(kept)
        if not lists:
            del _keeping[device]
    _here.modes.remove(mode)


def under_way(device: tuple[str, int]) -> bool:
    """Whether aiostream has a capture under way on ``device`` (lock-free, for fast paths)."""
    return device in _keeping


def keep(device: tuple[str, int], *objects: object) -> None:
    """Keep ``objects`` alive as long as the graphs of the captures under way on ``device``."""
    with _lock:
        for kept in _keeping.get(device, ()):
            kept.extend(objects)


def check_allocation(capturing_stream: str | None) -> None:
    """Raise if memory may not be allocated now: on the thread of a capture begun in a mode
    other than ``"relaxed"``, or on a capturing stream (``capturing_stream`` names it)."""
    modes: list[str] = _here.__dict__.get("modes", [])
    strict = [m for m in modes if m != "relaxed"]
    if strict:
        raise capture_allocation(strict[-1])
    if capturing_stream is not None:
        raise CaptureError(
            f"memory cannot be allocated on {capturing_stream}, which is capturing a graph "
            "(the allocation would become part of the graph): allocate buffers before the "
            "capture begins, or on a stream outside it"
        )
