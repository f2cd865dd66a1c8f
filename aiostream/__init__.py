"""aiostream: GPU streams and events as first-class citizens of async Python.

``await event.synchronize()`` suspends only the calling task, on asyncio, uvloop and trio, on
real GPUs (``cuda:N``) and on the deterministic simulated device (``virtual:N``).
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

try:
    from . import virtual
    from ._diagnostics import PendingWait, pending_waits, set_debug, set_watchdog
    from ._errors import (
        AiostreamError,
        BackendUnavailableError,
        CaptureError,
        CudaError,
        DeviceError,
        NotReadyError,
        StaleHandleError,
    )
    from ._waiting import get_wait_strategy, set_wait_strategy
    from .buffers import DeviceBuffer, HostBuffer, copy_async, from_dlpack
    from .device import Device, device, device_count, is_available
    from .event import Event
    from .graph import Graph
    from .interop import as_event, as_stream
    from .loader import Batch, DataLoader, LoaderStats
    from .profiler import Profiler, Span, Summary, profile, record_function
    from .stream import ExternalStream, Stream, current_stream, default_stream, delay, use_stream
except ImportError as _error:  # another distribution's files in this folder?
    from ._clash import explain as _explain

    _explain(_error)
    raise

try:
    __version__ = _version("aiostream-cuda")
except _PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "AiostreamError",
    "BackendUnavailableError",
    "Batch",
    "CaptureError",
    "CudaError",
    "DataLoader",
    "Device",
    "DeviceBuffer",
    "DeviceError",
    "Event",
    "ExternalStream",
    "Graph",
    "HostBuffer",
    "LoaderStats",
    "NotReadyError",
    "PendingWait",
    "Profiler",
    "Span",
    "StaleHandleError",
    "Stream",
    "Summary",
    "__version__",
    "as_event",
    "as_stream",
    "copy_async",
    "current_stream",
    "default_stream",
    "delay",
    "device",
    "device_count",
    "from_dlpack",
    "get_wait_strategy",
    "is_available",
    "pending_waits",
    "profile",
    "record_function",
    "set_debug",
    "set_wait_strategy",
    "set_watchdog",
    "use_stream",
    "virtual",
]


def __dir__() -> list[str]:
    """The documented names only (submodules stay importable, and are not listed)."""
    return sorted(__all__)
