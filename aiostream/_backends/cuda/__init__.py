"""The CUDA backend: native driver calls through cuda-python (``cuda.bindings.driver``).

Each device runs on its primary context, retained on first use and released last, at
:meth:`CudaBackend.close` (registered with ``atexit``), after every event, stream and module
the backend still holds, unless memory the program still holds keeps it (its host views may
still be read by later ``atexit`` handlers: the process's end frees it). Handles are released
exactly once, from whichever thread drops them; the driver calls that create things run with
the device's context pushed, so the calling thread's own current context is left as it was.

The modules:

- ``driver``: loading the bindings, and ``Driver.check`` / ``Driver.error``, the one place
  where a ``CUresult`` becomes an :class:`aiostream.CudaError`;
- ``handles``: the streams, events and memory given out;
- ``devices``: per-device state (context, a bounded pool of markers for memory frees, the
  sleep kernel, the watcher) and the registry of devices in use, with the backend's one lock;
- ``watcher``: marks (values the device writes into pinned memory when work completes), the
  wait targets on them, and the one thread per device that tells the waiting loops;
- ``waits``: what a stream's or an event's capture is (a new mark, or the mark of the event's
  last record), and when a host function announces it;
- ``memory``: host and device memory, and copies;
- ``backend``: :class:`CudaBackend`, the :class:`~aiostream._backends.base.Backend` protocol
  over the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import CudaBackend
    from .driver import load_driver

__all__ = ["CudaBackend", "load_driver"]


def __getattr__(name: str) -> Any:
    # Loaded when first asked for: the registry asks ``driver`` whether a driver library is
    # there at all before the backend's modules (numpy among them) load.
    if name == "CudaBackend":
        from .backend import CudaBackend

        return CudaBackend
    if name == "load_driver":
        from .driver import load_driver

        return load_driver
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
