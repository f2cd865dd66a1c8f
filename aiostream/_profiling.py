"""The hooks that the profiler plugs into; nothing here costs more than a global check when
no profiler is active.

``active`` is the running :class:`aiostream.profiler.Profiler` (or None); ``nvtx`` is the
``nvtx`` module once a CUDA backend is in use and the package is installed (or None).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .profiler import Profiler
    from .stream import Stream

active: Profiler | None = None
nvtx: Any = None

_NOTHING = contextlib.nullcontext()


def device_range(name: str, stream: Stream) -> contextlib.AbstractContextManager[Any]:
    """Bracket work submitted to ``stream`` with timing events, for backends whose own
    timeline does not already show it (the virtual backend's does)."""
    prof = active
    if prof is None or prof.native_timeline(stream):
        return _NOTHING
    return _event_range(prof, name, stream)


@contextlib.contextmanager
def _event_range(prof: Profiler, name: str, stream: Stream) -> Iterator[None]:
    start = prof.mark(stream)
    try:
        yield
    finally:
        prof.add_device_range(name, stream, start, prof.mark(stream), {}, op=True)
