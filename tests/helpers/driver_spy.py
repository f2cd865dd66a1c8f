"""Counting the driver calls aiostream makes, as the bindings see them: on any driver.

aiostream's CUDA backend calls cuda-python's bindings by attribute (``cu.cuLaunchHostFunc``),
so a test can count the calls of an entry point by wrapping the bindings' function. This works
on a GPU as on the stand-in driver, unlike the stand-in's own counters
(``tests/helpers/stand_in.py``), which count what the driver *ran*. Calls the backend makes
through ctypes are not seen: its host functions are launched so (``cuLaunchHostFunc`` through
the driver's own entry point), and only the stand-in counts those.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class Calls:
    """How many calls of each spied entry point were made, and how many succeeded."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self.made = dict.fromkeys(names, 0)
        self.succeeded = dict.fromkeys(names, 0)

    def count(self, name: str, ok: bool) -> None:
        with self._lock:
            self.made[name] += 1
            self.succeeded[name] += ok

    def __getitem__(self, name: str) -> int:
        """The successful calls of ``name`` so far."""
        with self._lock:
            return self.succeeded[name]


@contextlib.contextmanager
def spying(*names: str) -> Iterator[Calls]:
    """Count, while the block runs, the calls of the driver entry points ``names`` made
    through the bindings, from any thread (the backend's watcher thread too)."""
    from cuda.bindings import driver

    calls = Calls(names)
    real = {name: getattr(driver, name) for name in names}

    def spy(name: str, fn: Any) -> Any:
        def counted(*args: Any) -> Any:
            result = fn(*args)
            calls.count(name, int(result[0]) == 0)
            return result

        return counted

    for name, fn in real.items():
        setattr(driver, name, spy(name, fn))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(driver, name, fn)
