"""Devices: names of the form ``kind:index``, and the default device."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import _backends, _check
from ._errors import BackendUnavailableError

__all__ = ["Device", "device", "device_count", "is_available"]

_ACCEPTED = (
    "a Device, 'virtual', 'virtual:N', 'cuda' or 'cuda:N' (N a device index), or None for "
    "the default device"
)


@dataclass(frozen=True, slots=True)
class Device:
    """A device: a backend kind and an index, such as ``virtual:0`` or ``cuda:1``.

    Example:
        >>> str(Device("virtual", 0))
        'virtual:0'
    """

    type: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.type not in _backends.KINDS:
            raise ValueError(
                f"Device type must be one of {', '.join(map(repr, _backends.KINDS))}, "
                f"got {self.type!r}"
            )
        # frozen: a numpy integer is stored as the int it stands for
        object.__setattr__(self, "index", _check.integer(self.index, "Device index", minimum=0))

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


def _check_kind(kind: object) -> str:
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a str, one of {_backends.KINDS}, got {kind!r}")
    if kind not in _backends.KINDS:
        raise ValueError(
            f"kind must be one of {', '.join(map(repr, _backends.KINDS))}, got {kind!r}"
        )
    return kind


def is_available(kind: str) -> bool:
    """Return whether the ``kind`` backend (``"cuda"`` or ``"virtual"``) works here."""
    return _backends.probe(_check_kind(kind))[0]


def device_count(kind: str) -> int:
    """Return how many devices the ``kind`` backend has (0 when it is unavailable)."""
    _check_kind(kind)
    try:
        return _backends.get(kind).device_count()
    except BackendUnavailableError:
        return 0


def _parse(spec: str) -> Device:
    kind, sep, index = spec.strip().partition(":")
    if kind not in _backends.KINDS or (sep and not (index.isascii() and index.isdigit())):
        raise ValueError(f"device spec {spec!r} is not valid; expected {_ACCEPTED}")
    return Device(kind, int(index) if sep else 0)


def _default() -> Device:
    env = os.environ.get("AIOSTREAM_DEVICE")
    if env:
        try:
            return _parse(env)
        except ValueError:
            raise ValueError(
                f"AIOSTREAM_DEVICE={env!r} is not a valid device; expected 'virtual', "
                "'virtual:N', 'cuda' or 'cuda:N'"
            ) from None
    return (
        Device("cuda", 0) if is_available("cuda") and device_count("cuda") else Device("virtual", 0)
    )


def device(spec: Device | str | None = None) -> Device:
    """Resolve a device spec to a :class:`Device` that exists on this machine.

    Args:
        spec: a ``Device``, ``"virtual"``, ``"virtual:1"``, ``"cuda"``, ``"cuda:0"``, or None
            for the default device: ``$AIOSTREAM_DEVICE`` if set, else ``cuda:0`` where CUDA
            works, else ``virtual:0``.

    Raises:
        TypeError: ``spec`` is not a Device, str or None.
        ValueError: ``spec`` is malformed, or its index is past the device count.
        BackendUnavailableError: the backend cannot be used here (the message says why).
    """
    if spec is None:
        dev = _default()
    elif isinstance(spec, Device):
        dev = spec
    elif isinstance(spec, str):
        dev = _parse(spec)
    else:
        raise TypeError(f"device must be {_ACCEPTED}; got {spec!r} of type {type(spec).__name__}")
    count = _backends.get(dev.type).device_count()
    if dev.index >= count:
        hint = " (aiostream.virtual.reset(devices=N) makes more)" if dev.type == "virtual" else ""
        raise ValueError(
            f"device {dev} does not exist: the {dev.type} backend has {count} "
            f"device{'s' if count != 1 else ''} ({dev.type}:0 to {dev.type}:{count - 1}){hint}"
        )
    return dev
