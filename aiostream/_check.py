"""Argument validators shared by the public calls: one wording for one mistake everywhere.

At the ground floor: imports nothing of the package. Each returns the value, normalised, or
raises TypeError (wrong kind of value) or ValueError (right kind, wrong value), naming the
argument and what it got.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["MAX_HANDLE", "MAX_SECONDS", "flag", "handle", "integer", "number", "seconds"]

#: The longest duration a device's clock holds: 2**63 nanoseconds, rounded down (292 years).
MAX_SECONDS = 9.2e9


def flag(value: object, name: str) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def integer(
    value: object,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    what: str = "an int",
) -> int:
    """``value`` as an int (numpy integers too, never a bool), within the bounds given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {number}")
    return number


#: The largest value a driver handle (a pointer) can have.
MAX_HANDLE = 2**64 - 1


def handle(value: object, name: str, what: str) -> int:
    """``value`` as a driver handle: an int in the pointer range, 0 to 2**64 - 1."""
    number = integer(value, name, what=what)
    if not 0 <= number <= MAX_HANDLE:
        raise ValueError(
            f"{name} must be a pointer, 0 to 2**64 - 1 (a live handle from the library that "
            f"made it), got {number}"
        )
    return number


def number(
    value: object, name: str, *, positive: bool = False, what: str = "a number (int or float)"
) -> float:
    """``value`` as a finite float, >= 0 (> 0 with ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    low_ok = value > 0 if positive else value >= 0
    if not (low_ok and math.isfinite(value)):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


def seconds(
    value: object, name: str, *, positive: bool = False, what: str = "a number (int or float)"
) -> float:
    """``value`` as a duration in seconds (see :func:`number`), at most :data:`MAX_SECONDS`."""
    duration = number(value, name, positive=positive, what=what)
    if duration > MAX_SECONDS:
        raise ValueError(f"{name} must be at most {MAX_SECONDS:g} (292 years), got {value!r}")
    return duration
