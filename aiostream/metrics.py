"""Prometheus metrics for aiostream: see :mod:`aiostream.observe.metrics`, where they are counted.

This is the public path (``import aiostream.metrics``); it re-exports the names, so that a type
checker sees them, and names them as its own, so that a repr says what to import.
"""

from .observe.metrics import PrometheusMetrics

PrometheusMetrics.__module__ = __name__

__all__ = ["PrometheusMetrics"]
