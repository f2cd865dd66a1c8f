"""The loops of a test module whose tests run in virtual time: asyncio's default loop and trio.

uvloop keeps its own clock, in libuv, which virtual time cannot fake. A module takes these
loops instead of the suite's three by naming the fixture so::

    from tests.helpers import virtual_loops

    anyio_backend = virtual_loops.anyio_backend  # the module's loops: asyncio and trio
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Virtual time runs on asyncio's default loop and on trio (uvloop cannot fake time)."""
    return str(request.param)
