"""The installed distribution's version, read from its metadata on first use (``import
aiostream`` reads nothing): ``aiostream.__version__`` and the instrumentation's scope."""

from __future__ import annotations

import functools

__all__ = ["DISTRIBUTION", "version"]

DISTRIBUTION = "aiostream-cuda"


@functools.cache
def version() -> str:
    """This distribution's version; ``0+unknown`` in a source tree that was not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"
