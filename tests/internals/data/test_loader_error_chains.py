"""The data loader's insides: how a closing error is chained to the block's error
(``aiostream.data.loader._after``), walked on chains that hold cycles. What users see of it
(neither error lost, the block's in the closing error's context) is tested in
``tests/data/test_loader_errors.py``."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(30)  # a walk that never ends hangs
def test_chaining_a_closing_error_to_the_block_s_never_makes_a_cycle() -> None:
    """The block's error goes at the end of the closing error's context chain, unless it is
    there already, or the closing error is in the block's own chain (linking them would make
    a cycle, which tracebacks would follow forever); a cycle already in a chain ends the walk."""
    from aiostream.data.loader import _after

    inner, block = ValueError("inner"), RuntimeError("block")
    block.__context__ = inner
    _after(inner, block)  # closing raised an error the block's already holds
    assert inner.__context__ is None
    closing, middle = OSError("closing"), KeyError("middle")
    closing.__context__ = middle
    _after(closing, block)
    assert (closing.__context__, middle.__context__) == (middle, block)
    _after(closing, block)  # already at its end: nothing changes
    assert (closing.__context__, middle.__context__, block.__context__) == (middle, block, inner)
    a, b, other = ValueError("a"), ValueError("b"), RuntimeError("other")
    a.__context__, b.__context__, other.__context__ = b, a, a  # a cycle in the block's chain
    last = OSError("last")
    _after(last, other)
    assert last.__context__ is other
    deep, upper, outer = ValueError("deep"), KeyError("upper"), RuntimeError("outer")
    outer.__context__, upper.__context__ = upper, deep  # the closing error, two links down
    _after(deep, outer)
    assert deep.__context__ is None
    x, y, z = ValueError("x"), ValueError("y"), RuntimeError("z")
    x.__context__, y.__context__ = y, x  # a cycle in the closing error's own chain
    _after(x, z)  # ends: the chain has no end to link to
    assert (x.__context__, y.__context__, z.__context__) == (y, x, None)
