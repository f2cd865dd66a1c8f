"""Testing async GPU code: a pytest plugin with virtual time, isolated virtual devices, and faults.

Installed with aiostream as the pytest plugin ``aiostream`` (entry point ``pytest11``). It works
beside pytest-asyncio and anyio's pytest plugin, in their strict modes. Fixtures:

- ``virtual_device``: a fresh, isolated virtual backend for the test, yielding ``virtual:0``;
  configured by ``@pytest.mark.aiostream(devices=2, compute_slots=2, ...)``. At teardown it fails
  the test if a wait, operation, stream or event leaked, listing them, and restores the backend
  that was there before.
- ``virtual_time``: the test runs on a fake clock that jumps to the next timer or device
  completion whenever every task is blocked; ``asyncio.sleep``/``anyio.sleep`` and device work
  share it, so ten simulated seconds take microseconds. On asyncio's default loop and on trio;
  uvloop cannot take a fake clock, so such tests skip there, saying why.
- ``aiostream_device``: parametrized over every backend (``virtual:0``, and ``cuda:0``, which
  skips with the reason where no GPU works).

Outside pytest, :func:`run_in_virtual_time` runs an async function the same way.

The option ``--aiostream-timelines=DIR`` writes each test's device timeline to
``DIR/<test id>.timeline`` (see :func:`format_timeline`).
"""

from __future__ import annotations

from ._plugin import (  # noqa: F401 - pytest finds the plugin's hooks in this module
    VirtualTime,
    aiostream_device,
    format_timeline,
    pytest_addoption,
    pytest_configure,
    pytest_generate_tests,
    pytest_runtest_makereport,
    run_in_virtual_time,
    virtual_device,
    virtual_time,
)

__all__ = [
    "VirtualTime",
    "aiostream_device",
    "format_timeline",
    "run_in_virtual_time",
    "virtual_device",
    "virtual_time",
]
