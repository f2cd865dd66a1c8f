"""The backend protocol, reached as the user objects reach it: besides public names, the one
seam the tests may use (``aiostream/_backends/base.py`` documents each method). Tests that
need more of the package's insides live in ``tests/internals/``.
"""

from __future__ import annotations

from typing import Any

from aiostream import _backends, _objects
from aiostream._backends.base import AnyBackend

#: the wait strategies, as docs/cuda.md's "Waiting strategies" names them, the default first
STRATEGIES = ("quiet", "hybrid", "poll", "thread", "callback")
#: the strategies whose watched CUDA waits a host function announces (docs/cuda.md)
ANNOUNCED = frozenset({"hybrid", "callback"})


def backend(kind: str) -> AnyBackend:
    """The backend of ``kind`` in use (``"virtual"`` or ``"cuda"``), made on first use."""
    return _backends.get(kind)


def installed(kind: str) -> AnyBackend | None:
    """The backend of ``kind`` in use now, or None (none is made)."""
    return _backends.installed(kind)


def backend_of(obj: Any) -> AnyBackend:
    """The backend a stream, event or buffer belongs to."""
    return _objects.backend(obj)


def handle_of(obj: Any) -> Any:
    """The backend's handle of a stream, event or buffer (None: an event never recorded)."""
    return _objects.handle(obj)
