"""OpenTelemetry spans for aiostream: see :mod:`aiostream.observe.tracing`, where they are made.

This is the public path (``import aiostream.tracing``); it re-exports the names, so that a
type checker sees them, and names them as its own, so that a repr says what to import.
"""

from .observe.tracing import Tracing, instrument

Tracing.__module__ = __name__

__all__ = ["Tracing", "instrument"]
