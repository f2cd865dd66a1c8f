"""The fixtures of the CUDA tests, black-box (``tests/cuda/``) and white-box
(``tests/internals/cuda/``) alike: each folder's ``conftest.py`` takes them from here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import aiostream as ais
from tests.helpers import cuda, gate
from tests.helpers.stand_in import hurry, keeping_the_contract


@pytest.fixture
def contract() -> Iterator[None]:
    """The test starts with no violation of the driver's contract counted on the stand-in,
    and must end with none; the kernels it left running end, and the default wait strategy
    and debug mode come back after it. A gate (tests/helpers/gate.py) it left held is
    released, and fails it."""
    with keeping_the_contract():
        yield
        left_held = gate.release_all()
        ais.set_wait_strategy(None)
        ais.set_debug(False)
        hurry()
        gate.sweep()
        assert not left_held, f"the test left {left_held} gate(s) held: use gated(), or release"


@pytest.fixture
def own_backend() -> Iterator[Any]:
    """A CUDA backend of the test's own, installed for the test (objects made meanwhile use
    it) and closed after it, as the process's exit closes the shared one."""
    with cuda.own_backend() as backend:
        yield backend
