"""Which lane runs (tests/conftest.py sets it from ``--run-slow`` before any test module is
imported): property tests take their full number of examples in the full lane only."""

from __future__ import annotations

full = False


def examples(n: int) -> int:
    """How many examples a property test of ``n`` examples runs: all in the full lane, a tenth
    (at least 10) in the fast lane. Both draws are derandomized, so each lane is repeatable."""
    return n if full else max(10, n // 10)
