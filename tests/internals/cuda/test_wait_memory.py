"""What a pending CUDA wait costs in memory, its task included: under 2 KiB from 1,000 waits
on (``pending_memory`` of ``benchmarks/cuda_waits.py``, tracemalloc), on events recorded on
100 streams and on streams of their own (a mark each)."""

from __future__ import annotations

import pytest

from benchmarks.cuda_waits import pending_memory
from tests.helpers.cuda import DEV

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("contract")]


@pytest.mark.parametrize("on", ["events", "streams"])
def test_a_pending_wait_is_under_2_kib(on: str) -> None:
    assert pending_memory(DEV, 1000, on) < 2048
