"""The virtual backend: a deterministic simulated device.

- ``clock``: integer-nanosecond time, :class:`VirtualClock`, listener lists;
- ``options``: :class:`VirtualOptions`, the one validated record of a backend's options;
- ``profile``: :class:`DeviceProfile`, a device's measured figures (``calibrate``'s file);
- ``model``: devices, engines, streams, items, events, memory, and the public records;
- ``scheduler``: the discrete-event core (pure: no lock, no clock), O(log n) per event;
- ``inspect``: the leak listing;
- ``backend``: :class:`VirtualBackend`, the Backend protocol over the scheduler, under a lock.
"""

from __future__ import annotations

from .backend import POISON, Isolation, Target, VirtualBackend
from .clock import VirtualClock, seconds_to_ns
from .model import ENGINES, PRIORITY_RANGE, OpRecord, Race, VirtualStats
from .options import (
    DEFAULT_BANDWIDTH,
    DEFAULT_D2D_BANDWIDTH,
    DEFAULT_LATENCY,
    DEFAULT_MEMORY,
    MAX_DEVICES,
    PROFILE_VARIABLE,
    VirtualOptions,
)
from .profile import DeviceProfile
from .scheduler import TIMELINE_LIMIT, Scheduler

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_D2D_BANDWIDTH",
    "DEFAULT_LATENCY",
    "DEFAULT_MEMORY",
    "ENGINES",
    "Isolation",
    "MAX_DEVICES",
    "POISON",
    "PROFILE_VARIABLE",
    "DeviceProfile",
    "PRIORITY_RANGE",
    "TIMELINE_LIMIT",
    "OpRecord",
    "Race",
    "Scheduler",
    "Target",
    "VirtualBackend",
    "VirtualClock",
    "VirtualOptions",
    "VirtualStats",
    "seconds_to_ns",
]
