"""Testing async GPU code: virtual time, isolated virtual devices and faults, with or without
pytest.

- :func:`run_in_virtual_time` runs an async function on a fresh virtual device whose clock is a
  fake loop clock: simulated seconds take microseconds, and the result is exact. It needs no
  pytest.
- :class:`VirtualTime` is that clock, as the ``virtual_time`` fixture hands it to a test.
- :func:`format_timeline` writes a device timeline as canonical text.

The pytest plugin (fixtures ``virtual_device``, ``virtual_time``, ``aiostream_device``, the
``@pytest.mark.aiostream(...)`` marker, ``--aiostream-timelines``) is
:mod:`aiostream.testing.plugin`, registered through the ``pytest11`` entry point.
"""

from .._virtual_time import VirtualTime, format_timeline, run_in_virtual_time

__all__ = ["VirtualTime", "format_timeline", "run_in_virtual_time"]


def __dir__() -> list[str]:
    return sorted(__all__)
