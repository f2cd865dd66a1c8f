"""Device profiles: what ``python -m aiostream calibrate`` measured on a device, read back.

A profile is a small JSON file: a format name and version, the device it was measured on
(name, driver, date), and a table of figures, each a value with its spread (half the range
of the repeated measurements, or the fit's error). ``load`` checks every field and raises
``ValueError`` naming the file and the field; a virtual device made from a profile
(``aiostream.virtual.reset(profile=...)``) takes its copy latencies and bandwidths, its launch
overhead and its engines' concurrency from it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COPY_KINDS", "FIGURES", "FORMAT", "VERSION", "DeviceProfile", "Figure"]

FORMAT = "aiostream-device-profile"
VERSION = 1

#: The copies a profile measures: each direction from pinned and from pageable host memory,
#: and device to device.
COPY_KINDS = ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "d2d")

_SECONDS, _RATE, _COUNT, _FRACTION = "s", "bytes/s", "count", "fraction"

#: Every figure a profile holds, with its unit, and what it means.
FIGURES: dict[str, tuple[str, str]] = {
    **{
        f"{kind}_{what}": (unit, text.format(kind=kind.replace("_", " from ")))
        for kind in COPY_KINDS
        for what, unit, text in (
            ("latency_s", _SECONDS, "{kind}: fixed seconds of a copy (the fit's intercept)"),
            ("bandwidth", _RATE, "{kind}: bytes per second (the fit's slope)"),
            ("fit_error", _FRACTION, "{kind}: the fit's largest relative error over the sizes"),
        )
    },
    "launch_s": (_SECONDS, "kernel: from its submission to its start, on an idle stream"),
    "gap_s": (_SECONDS, "kernel: between the end of one and the start of the next, queued"),
    "compute_slots": (_COUNT, "small kernels that run at once"),
    "h2d_slots": (_COUNT, "host-to-device copies that run at once at full speed"),
    "d2h_slots": (_COUNT, "device-to-host copies that run at once at full speed"),
    "host_fn_s": (_SECONDS, "from the end of work to a waiting task's wake-up (callback)"),
    "event_record_s": (_SECONDS, "an event record's cost on the stream"),
}


@dataclass(frozen=True)
class Figure:
    """One measured figure: its value and its spread, in the figure's unit."""

    value: float
    spread: float = 0.0


@dataclass(frozen=True, eq=False)
class DeviceProfile:
    """A device's measured figures (see ``FIGURES``) and where they were measured.

    Example:
        >>> p = DeviceProfile.load("profile.json")  # doctest: +SKIP
        >>> p.name, p.figures["h2d_pinned_bandwidth"].value  # doctest: +SKIP
        ('NVIDIA H200', 5.2e10)
    """

    name: str
    """The device's name, as its driver gives it."""
    driver: str
    """The driver's version."""
    date: str
    """When it was measured (ISO 8601, UTC)."""
    measured_on: str
    """The aiostream device it was measured on (``cuda:0``)."""
    figures: dict[str, Figure] = field(repr=False)
    source: str = ""
    """The file it was read from ("" when made in memory)."""

    def __post_init__(self) -> None:
        where = self.source or "profile"
        for key in ("name", "driver", "date", "measured_on"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"{where}: device.{key} must be a non-empty string")
        missing = [name for name in FIGURES if name not in self.figures]
        if missing:
            raise ValueError(f"{where}: figures.{missing[0]} is missing")
        unknown = sorted(set(self.figures) - set(FIGURES))
        if unknown:
            raise ValueError(
                f"{where}: figures.{unknown[0]} is not a figure of version {VERSION} profiles"
            )
        for name, (unit, _) in FIGURES.items():
            figure = self.figures[name]
            _check(where, name, "value", figure.value, unit)
            _check(where, name, "spread", figure.spread, "")

    def value(self, name: str) -> float:
        return self.figures[name].value

    def describe(self) -> str:
        """One line: what the profile was measured on."""
        return f"{self.name} (driver {self.driver}, {self.measured_on}, {self.date})"

    # ------------------------------------------------------------------ the file

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "device": {
                "name": self.name,
                "driver": self.driver,
                "date": self.date,
                "measured_on": self.measured_on,
            },
            "figures": {
                name: {
                    "value": self.figures[name].value,
                    "spread": self.figures[name].spread,
                    "unit": unit,
                    "what": text,
                }
                for name, (unit, text) in FIGURES.items()
            },
        }

    def dump(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceProfile:
        """Read and check a profile; ``ValueError`` naming the file (and the field) if it is
        not one, or cannot be read."""
        where = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: not a profile: the file cannot be read ({exc})") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{where}: not a profile: the JSON does not parse ({exc})") from None
        return cls.from_dict(data, source=where)

    @classmethod
    def from_dict(cls, data: object, *, source: str = "") -> DeviceProfile:
        where = source or "profile"
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(
                f"{where}: format: not an aiostream device profile (made by "
                "python -m aiostream calibrate)"
            )
        version = data.get("version")
        if version != VERSION:
            raise ValueError(
                f"{where}: version: {version!r} is not a version this aiostream reads "
                f"({VERSION}); measure the device again with python -m aiostream calibrate"
            )
        device = data.get("device")
        if not isinstance(device, dict):
            raise ValueError(f"{where}: device is missing (an object: name, driver, date)")
        figures = data.get("figures")
        if not isinstance(figures, dict):
            raise ValueError(f"{where}: figures is missing (an object of figures)")
        parsed: dict[str, Figure] = {}
        for name, entry in figures.items():
            if not isinstance(entry, dict) or "value" not in entry:
                raise ValueError(f"{where}: figures.{name} must be an object with a value")
            parsed[name] = Figure(entry["value"], entry.get("spread", 0.0))
        return cls(
            name=device.get("name"),  # type: ignore[arg-type] # checked by __post_init__
            driver=device.get("driver"),  # type: ignore[arg-type]
            date=device.get("date"),  # type: ignore[arg-type]
            measured_on=device.get("measured_on"),  # type: ignore[arg-type]
            figures=parsed,
            source=source,
        )


def _check(where: str, name: str, part: str, value: object, unit: str) -> None:
    field_ = f"figures.{name}.{part}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {field_} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {field_} must be a finite number >= 0, got {value!r}")
    if unit == _RATE and value < 1:
        raise ValueError(f"{where}: {field_} must be >= 1 (bytes per second), got {value!r}")
    if unit == _COUNT and (value < 1 or value != int(value)):
        raise ValueError(f"{where}: {field_} must be a whole number >= 1, got {value!r}")
