"""The options of a virtual backend, in one frozen, validated record.

``aiostream.virtual.reset``, the pytest marker ``@pytest.mark.aiostream`` and
``run_in_virtual_time`` all take these names; this is the one place they are defined and
checked.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

from .clock import seconds_to_ns
from .profile import COPY_KINDS, DeviceProfile

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_D2D_BANDWIDTH",
    "DEFAULT_LATENCY",
    "DEFAULT_MEMORY",
    "MAX_DEVICES",
    "PROFILE_VARIABLE",
    "VirtualOptions",
]

#: The environment variable naming a profile for every virtual backend made without one.
PROFILE_VARIABLE = "AIOSTREAM_VIRTUAL_PROFILE"
#: The options a profile sets: giving one of them beside a profile is a contradiction.
_PROFILED = ("compute_slots", "h2d_slots", "d2h_slots", "bandwidth", "latency", "d2d_bandwidth")

#: Bytes per second of host-device copies: near a PCIe 4.0 x16 link in practice.
DEFAULT_BANDWIDTH = 25e9
#: Seconds every copy adds to its transfer time.
DEFAULT_LATENCY = 10e-6
#: Device-to-device copies run on the compute engine at device-memory speed.
DEFAULT_D2D_BANDWIDTH = 1e12
#: Bytes of memory per device: a virtual device refuses allocations past it, as a GPU does.
#: Its bytes live in host memory, as they are allocated.
DEFAULT_MEMORY = 16 << 30
_MAX_MEMORY = 1 << 50
#: More simulated devices than any machine has GPUs is a mistake, not a configuration.
MAX_DEVICES = 1024
_MAX_SLOTS = 1 << 20


def _count(value: object, name: str, limit: int) -> int:
    """``value`` as an int: Python's and numpy's integers, never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    count = int(value)
    if count < 1:
        raise ValueError(f"{name} must be >= 1, got {count}")
    if count > limit:
        raise ValueError(f"{name} must be at most {limit}, got {count}")
    return count


def _rate(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    rate = float(value)
    if not (1 <= rate and math.isfinite(rate)):
        raise ValueError(f"{name} must be a finite number >= 1 (bytes per second), got {value!r}")
    return rate


@dataclass(frozen=True)
class VirtualOptions:
    """How a virtual backend simulates its devices; every field is checked when it is made.

    Example:
        >>> VirtualOptions(devices=2, compute_slots=4).compute_slots
        4
    """

    devices: int = 1
    """How many devices (``virtual:0`` .. ``virtual:{devices-1}``)."""
    compute_slots: int = 1
    """Operations the compute engine of each device runs at once."""
    h2d_slots: int = 1
    """Likewise for the host-to-device copy engine."""
    d2h_slots: int = 1
    """Likewise for the device-to-host copy engine."""
    bandwidth: float = DEFAULT_BANDWIDTH
    """Bytes per second of host-device copies."""
    latency: float = DEFAULT_LATENCY
    """Seconds every copy adds: a copy takes ``latency + nbytes / bandwidth``."""
    d2d_bandwidth: float = DEFAULT_D2D_BANDWIDTH
    """Bytes per second of device-to-device copies, which run on the compute engine."""
    memory: int = DEFAULT_MEMORY
    """Bytes of memory per device; an allocation past what is free raises ``DeviceError``."""
    profile: Any = None
    """A :class:`DeviceProfile` or the path of one (``python -m aiostream calibrate`` writes
    them): the engines' concurrency, each copy's latency and bandwidth (by direction, pinned
    or pageable) and the kernels' launch overhead come from it. None: the file named by the
    environment variable ``AIOSTREAM_VIRTUAL_PROFILE`` if it is set and none of the options
    it sets (``compute_slots`` to ``d2d_bandwidth``) is given, else none: the variable is a
    default, which options given explicitly win over; False: none, whatever the environment
    says."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise through the base class
        set_(self, "devices", _count(self.devices, "devices", MAX_DEVICES))
        for name in ("compute_slots", "h2d_slots", "d2h_slots"):
            set_(self, name, _count(getattr(self, name), name, _MAX_SLOTS))
        set_(self, "memory", _count(self.memory, "memory", _MAX_MEMORY))
        set_(self, "bandwidth", _rate(self.bandwidth, "bandwidth"))
        set_(self, "d2d_bandwidth", _rate(self.d2d_bandwidth, "d2d_bandwidth"))
        set_(self, "latency", seconds_to_ns(self.latency, "latency") / 1e9)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        given = [name for name in _PROFILED if getattr(self, name) != defaults[name]]
        if self.profile is None and given:
            # the environment's profile is a default: options given explicitly win over it
            set_(self, "profile", False)
        set_(self, "profile", self._profile())
        if self.profile is not None and given:
            raise ValueError(
                f"{', '.join(given)} given beside a profile, which sets them: leave "
                "them out, or leave the profile out"
            )

    def _profile(self) -> DeviceProfile | None:
        profile = self.profile
        if profile is False:  # none, whatever the environment says
            return None
        if profile is None:
            path = os.environ.get(PROFILE_VARIABLE) or None
            if path is None:
                return None
            try:
                return DeviceProfile.load(path)
            except ValueError as exc:  # said where the file was named
                raise ValueError(f"{PROFILE_VARIABLE}: {exc}") from None
        if isinstance(profile, DeviceProfile):
            return profile
        if isinstance(profile, (str, os.PathLike)):
            return DeviceProfile.load(profile)
        raise TypeError(
            f"profile must be a DeviceProfile or a file's path, got {type(profile).__name__}"
        )

    @classmethod
    def from_kwargs(cls, **options: Any) -> VirtualOptions:
        """Build from keyword options, naming any that is not an option."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise TypeError(
                f"unknown virtual backend option(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(cls.names())}"
            )
        return cls(**options)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in their documented order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def slots(self) -> dict[str, int]:
        """Slots per engine."""
        p = self.profile
        if p is not None:
            return {name: int(p.value(f"{name}_slots")) for name in ("compute", "h2d", "d2h")}
        return {"compute": self.compute_slots, "h2d": self.h2d_slots, "d2h": self.d2h_slots}

    def copies(self) -> dict[str, tuple[float, float]]:
        """(latency in seconds, bytes per second) of each kind of copy (``COPY_KINDS``)."""
        p = self.profile
        if p is not None:
            return {k: (p.value(f"{k}_latency_s"), p.value(f"{k}_bandwidth")) for k in COPY_KINDS}
        model = {kind: (self.latency, self.bandwidth) for kind in COPY_KINDS}
        model["d2d"] = (self.latency, self.d2d_bandwidth)
        return model

    def lead_ns(self) -> tuple[int, int]:
        """The compute engine's (launch, gap) in nanoseconds: an operation starts no sooner
        than ``launch`` after its submission, nor than ``gap`` after its engine took it."""
        p = self.profile
        if p is None:
            return 0, 0
        return round(p.value("launch_s") * 1e9), round(p.value("gap_s") * 1e9)
