"""aiostream: GPU streams and events as first-class citizens of async Python.

``await event.synchronize()`` suspends only the calling task, on asyncio, uvloop and trio, on
real GPUs (``cuda:N``) and on the deterministic simulated device (``virtual:N``).
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

#: which distribution wrote this file: another project's ``aiostream/__init__.py`` has none
#: (``_distribution.shadowed`` reads it)
_DISTRIBUTION = "aiostream-cuda"

try:  # the core: devices, streams, events and waits
    from ._diagnostics import PendingWait, pending_waits, set_debug, set_watchdog
    from ._errors import (
        AiostreamError,
        BackendUnavailableError,
        CaptureError,
        CompletionError,
        CudaError,
        DeviceError,
        GraphUpdateError,
        NotReadyError,
        StaleHandleError,
    )
    from ._waiting import get_wait_strategy, set_wait_strategy
    from .device import Device, device, device_count, is_available
    from .event import Event
    from .stream import (
        ExternalStream,
        Stream,
        current_stream,
        default_stream,
        delay,
        is_current_stream_capturing,
        use_stream,
    )
except ImportError as _error:  # another distribution's files in this folder?
    from ._distribution import explain as _explain

    _explain(_error)
    raise

if _TYPE_CHECKING:
    from . import virtual
    from ._regions import record_function
    from .completions.adapters import Adapter, register_adapter
    from .completions.waits import wait
    from .data._staging import Batch
    from .data.buffers import DeviceBuffer, HostBuffer, copy_async, from_dlpack
    from .data.loader import DataLoader, LoaderStats
    from .graph import Graph
    from .interop import as_event, as_stream
    from .observe._spans import Span, Summary
    from .observe.profiler import Profiler, profile

    __version__: str

# The rest is imported on first use (``import aiostream`` stays light: numpy, the profiler's
# exporters and the loader load with what uses them): name -> its module.
_LAZY = {
    **dict.fromkeys(("Adapter", "register_adapter"), "completions.adapters"),
    "wait": "completions.waits",
    **dict.fromkeys(("DeviceBuffer", "HostBuffer", "copy_async", "from_dlpack"), "data.buffers"),
    "Graph": "graph",
    **dict.fromkeys(("as_event", "as_stream"), "interop"),
    "Batch": "data._staging",
    **dict.fromkeys(("DataLoader", "LoaderStats"), "data.loader"),
    **dict.fromkeys(("Profiler", "profile"), "observe.profiler"),
    **dict.fromkeys(("Span", "Summary"), "observe._spans"),
    "record_function": "_regions",
    "virtual": "virtual",
}


def __getattr__(name: str) -> _Any:
    if name == "__version__":
        from ._distribution import version

        value: _Any = version()
    elif name in _LAZY:
        try:
            module = _importlib.import_module(f".{_LAZY[name]}", __name__)
        except ImportError as error:  # another distribution's files in this folder?
            from ._distribution import explain

            explain(error)
            raise
        value = module if name == _LAZY[name] else getattr(module, name)
    else:
        raise AttributeError(f"module 'aiostream' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "Adapter",
    "AiostreamError",
    "BackendUnavailableError",
    "Batch",
    "CaptureError",
    "CompletionError",
    "CudaError",
    "DataLoader",
    "Device",
    "DeviceBuffer",
    "DeviceError",
    "Event",
    "ExternalStream",
    "Graph",
    "GraphUpdateError",
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
    "is_current_stream_capturing",
    "pending_waits",
    "profile",
    "record_function",
    "register_adapter",
    "set_debug",
    "set_wait_strategy",
    "set_watchdog",
    "use_stream",
    "virtual",
    "wait",
]


def __dir__() -> list[str]:
    """The documented names only (submodules stay importable, and are not listed)."""
    return sorted(__all__)
