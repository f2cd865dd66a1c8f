"""The profiler's NVTX slot (``aiostream._hooks``): ``record_function`` emits NVTX ranges once
the slot holds the ``nvtx`` module, which the CUDA backend puts there when it starts, only
where ``nvtx`` is installed. No public name reaches the slot without a CUDA device:
``tests/cuda/test_programs.py`` shows the ranges a program on the stand-in driver emits."""

from __future__ import annotations

import sys
import types

import pytest

import aiostream as ais
from aiostream import _hooks


def test_nvtx_ranges_when_available(
    virtual_device: ais.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, ...]] = []

    class FakeNvtx:
        def push_range(self, name: str) -> None:
            calls.append(("push", name))

        def pop_range(self) -> None:
            calls.append(("pop",))

    monkeypatch.setattr(_hooks, "nvtx", FakeNvtx())
    with ais.record_function("outer"):  # no profiler: NVTX only
        with ais.record_function("inner"):
            pass
    assert calls == [("push", "outer"), ("push", "inner"), ("pop",), ("pop",)]


def test_nvtx_is_turned_on_only_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend calls enable_nvtx() when it starts (tests/cuda/test_programs.py shows
    it)."""
    fake_nvtx = types.ModuleType("nvtx")
    monkeypatch.setattr(_hooks, "nvtx", None)
    monkeypatch.setitem(sys.modules, "nvtx", None)  # not installed: the import fails
    _hooks.enable_nvtx()
    assert _hooks.nvtx is None
    monkeypatch.setitem(sys.modules, "nvtx", fake_nvtx)
    _hooks.enable_nvtx()
    assert _hooks.nvtx is fake_nvtx
