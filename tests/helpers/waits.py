"""Small helpers around waits on any backend, and the virtual device's quiet check."""

from __future__ import annotations

from typing import Any

import aiostream as ais


async def synchronize_keeping(awaited: ais.Stream | ais.Event, errors: list[Any]) -> None:
    """``await awaited.synchronize()``, keeping a ``DeviceError`` it raises in ``errors``."""
    try:
        await awaited.synchronize()
    except ais.DeviceError as exc:
        errors.append(exc)


def assert_quiet() -> None:
    """Nothing pending on the virtual backend: no wait, no operation."""
    stats = ais.virtual.stats()
    assert stats.waits == 0, stats
    assert stats.operations == 0, stats


class ManualBackend:
    """A backend that knows no completion times and tells nothing by itself: the waiter's
    own looks (``WaitTarget.done``/``peek``) or a test's callback end its waits."""

    kind = "manual"
    completion_times = False

    def wake_hint(self, index: int) -> float | None:
        return None

    def subscribe(self, index: int, callback: object) -> object:
        return lambda: None
