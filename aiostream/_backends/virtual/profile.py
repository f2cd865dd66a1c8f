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
import stat
from dataclasses import dataclass, field
from typing import Any

from ..._check import MAX_SECONDS

__all__ = [
    "COPY_KINDS",
    "FIGURES",
    "FORMAT",
    "MAX_BYTES",
    "VERSION",
    "DeviceProfile",
    "Figure",
]

FORMAT = "aiostream-device-profile"
VERSION = 1

#: The most bytes a profile's file may hold (``calibrate`` writes about 6 KB): a larger file
#: is refused unread.
MAX_BYTES = 1 << 20
#: The most characters of a device's name, driver, date or aiostream device.
_MAX_TEXT = 200
#: The most a count may be: as many slots as ``aiostream.virtual.reset`` gives an engine.
_MAX_COUNT = 1 << 20

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
            text = getattr(self, key)
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}: device.{key} must be a non-empty string")
            if len(text) > _MAX_TEXT or not text.isprintable():
                raise ValueError(
                    f"{where}: device.{key} must be printable text of at most {_MAX_TEXT} "
                    f"characters (no line breaks or control characters), got {_show(text)}"
                )
        if not isinstance(self.figures, dict):
            raise ValueError(
                f"{where}: figures must be a dict of figure names to Figure or numbers, got "
                f"{_show(self.figures)}"
            )
        figures: dict[str, Figure] = {}
        for name, figure in self.figures.items():
            if isinstance(figure, Figure):
                figures[name] = figure
            elif isinstance(figure, (int, float)) and not isinstance(figure, bool):
                figures[name] = Figure(figure)  # its value alone, measured without spread
            else:
                raise ValueError(
                    f"{where}: figures.{_show_name(name)} must be a Figure or a number, got "
                    f"{_show(figure)}"
                )
        object.__setattr__(self, "figures", figures)  # frozen: set through the base class
        missing = [name for name in FIGURES if name not in self.figures]
        if missing:
            raise ValueError(f"{where}: figures.{missing[0]} is missing")
        unknown = sorted(set(self.figures) - set(FIGURES))
        if unknown:
            raise ValueError(
                f"{where}: figures.{_show_name(unknown[0])} is not a figure of version "
                f"{VERSION} profiles"
            )
        for name, (unit, _) in FIGURES.items():
            figure = self.figures[name]
            _check(where, name, "value", figure.value, unit)
            _check(where, name, "spread", figure.spread, "")

    def value(self, name: str) -> float:
        """The value of the figure ``name`` (one of ``FIGURES``); ``ValueError`` if there
        is no such figure."""
        figure = self.figures.get(name) if isinstance(name, str) else None
        if figure is None:
            raise ValueError(
                f"{_show(name)} is not a figure of version {VERSION} profiles; they are: "
                f"{', '.join(FIGURES)}"
            )
        return figure.value

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
        """Write the profile to the file ``path`` (a str or path-like: never a file
        descriptor, which ``open`` would take, and close)."""
        with open(_path(path), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceProfile:
        """Read and check a profile; ``ValueError`` naming the file (and the field) if it is
        not one, or cannot be read: only a regular file of at most ``MAX_BYTES`` (1 MiB) is
        read. ``path`` is a str or path-like (``TypeError`` otherwise)."""
        where = os.fsdecode(_path(path))
        try:
            text = _read(where, _path(path)).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: not a profile: the file cannot be read ({exc})") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{where}: not a profile: the JSON does not parse ({exc})") from None
        except RecursionError:
            raise ValueError(
                f"{where}: not a profile: the JSON does not parse (nested too deep)"
            ) from None
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
        if type(version) is not int or version != VERSION:  # true is no version
            raise ValueError(
                f"{where}: version: {_show(version)} is not a version this aiostream reads "
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
                raise ValueError(
                    f"{where}: figures.{_show_name(name)} must be an object with a value"
                )
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
        raise ValueError(f"{where}: {field_} must be a number, got {_show(value)}")
    try:
        number = float(value)  # an int too large for a float is no figure either
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{where}: {field_} must be a finite number >= 0, got {_show(value)}")
    if unit == _SECONDS and number > MAX_SECONDS:
        raise ValueError(
            f"{where}: {field_} must be at most {MAX_SECONDS:g} seconds (292 years, what a "
            f"device clock holds), got {_show(value)}"
        )
    if unit == _RATE and number < 1:
        raise ValueError(f"{where}: {field_} must be >= 1 (bytes per second), got {value!r}")
    if unit == _COUNT and (number < 1 or number > _MAX_COUNT or number != int(number)):
        raise ValueError(
            f"{where}: {field_} must be a whole number from 1 to {_MAX_COUNT}, got {_show(value)}"
        )


def _path(path: object) -> str | bytes:
    """``path`` as a file system path: a str, bytes or path-like; never an int, which
    ``open`` takes for a file descriptor."""
    if isinstance(path, int) or not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or an os.PathLike, got {_show(path)}")
    return os.fspath(path)


def _read(where: str, path: str | bytes) -> bytes:
    """The bytes of a profile's file: a regular file of at most ``MAX_BYTES``, read without
    blocking on a FIFO and no more than that however long it goes on (``/proc``)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)  # a FIFO opens at once, and is refused below
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(
                f"{where}: not a profile: not a regular file (a folder, a FIFO or a device)"
            )
        if info.st_size > MAX_BYTES:
            raise ValueError(
                f"{where}: not a profile: {info.st_size} bytes, over the {MAX_BYTES} a "
                "profile may hold"
            )
        chunks: list[bytes] = []
        left = MAX_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise ValueError(
                f"{where}: not a profile: over the {MAX_BYTES} bytes a profile may hold"
            )
        return b"".join(chunks)
    finally:
        os.close(fd)


def _show(value: object, most: int = 60) -> str:
    """``value``'s repr, cut to about ``most`` characters: what an error quotes of input."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**most:
        return f"an integer of over {most} digits"
    try:
        text = repr(value)
    except RecursionError:  # nested too deep to write
        return f"a {type(value).__name__} nested too deep to show"
    return text if len(text) <= most else f"{text[: most - 3]}..."


def _show_name(name: object) -> str:
    """A figure's name as an error writes it: as it is when it is a plain word, else quoted."""
    plain = isinstance(name, str) and name.isidentifier() and len(name) <= 60
    return name if plain else _show(name)  # type: ignore[return-value]
