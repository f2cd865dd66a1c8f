"""The profiler's NVTX slot (``aiostream._hooks``): ``record_function`` emits NVTX ranges once
the slot holds the ``nvtx`` module, which the CUDA backend puts there when it starts, only
where ``nvtx`` is installed. No public name reaches the slot without a CUDA device:
``tests/cuda/test_programs.py`` shows the ranges a program on the stand-in driver emits."""

from __future__ import annotations

import sys
import types

import anyio
import pytest

import aiostream as ais
from aiostream import _hooks


class FakeNvtx:
    """The nvtx package's start/end range functions, noting each call; a range's id is
    opaque to its caller (the package's is a tuple)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.open: dict[tuple[str, int], str] = {}

    def start_range(self, message: str | None = None, domain: str | None = None) -> object:
        range_id = ("id", len(self.calls))
        self.calls.append(("start", message))
        self.open[range_id] = f"{domain}/{message}"
        return range_id

    def end_range(self, range_id: tuple[str, int]) -> None:
        self.calls.append(("end", self.open.pop(range_id)))  # a KeyError: an id ended twice


def test_nvtx_ranges_when_available(
    virtual_device: ais.Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvtx()
    monkeypatch.setattr(_hooks, "nvtx", fake)
    with ais.record_function("outer"):  # no profiler: NVTX only
        with ais.record_function("inner"):
            pass
    assert fake.calls == [
        ("start", "outer"),
        ("start", "inner"),
        ("end", "aiostream/inner"),
        ("end", "aiostream/outer"),
    ]
    assert fake.open == {}


@pytest.mark.anyio
async def test_ranges_of_tasks_interleaved_across_awaits_each_end_their_own(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tasks on one loop thread: a enters, b enters, a leaves, b leaves. Each range ends
    with its own id (a thread's push/pop stack would end b's range at a's exit)."""
    fake = FakeNvtx()
    monkeypatch.setattr(_hooks, "nvtx", fake)
    a_in, b_in, a_out = anyio.Event(), anyio.Event(), anyio.Event()

    async def task_a() -> None:
        async with ais.record_function("a"):
            a_in.set()
            await b_in.wait()
        a_out.set()

    async def task_b() -> None:
        await a_in.wait()
        async with ais.record_function("b"):
            b_in.set()
            await a_out.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(task_a)
        tg.start_soon(task_b)
    assert fake.calls == [
        ("start", "a"),
        ("start", "b"),
        ("end", "aiostream/a"),
        ("end", "aiostream/b"),
    ]
    assert fake.open == {}


@pytest.mark.anyio
async def test_one_instance_entered_by_several_tasks_ends_each_range(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One record_function entered by two tasks at once: a range each, each ended."""
    fake = FakeNvtx()
    monkeypatch.setattr(_hooks, "nvtx", fake)
    shared = ais.record_function("shared")
    a_in, b_in, a_out = anyio.Event(), anyio.Event(), anyio.Event()

    async def task_a() -> None:
        with shared:
            a_in.set()
            await b_in.wait()
        a_out.set()

    async def task_b() -> None:
        await a_in.wait()
        with shared:
            b_in.set()
            await a_out.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(task_a)
        tg.start_soon(task_b)
    assert fake.calls == [
        ("start", "shared"),
        ("start", "shared"),
        ("end", "aiostream/shared"),
        ("end", "aiostream/shared"),
    ]
    assert fake.open == {}


def test_the_nvtx_package_takes_the_calls_as_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real package, where installed: its start_range and end_range take what
    record_function passes (with no tool attached they record nothing)."""
    nvtx = pytest.importorskip("nvtx", reason="the nvtx package is not installed")
    monkeypatch.setattr(_hooks, "nvtx", nvtx)
    with ais.record_function("real"):
        with ais.record_function("nested"):
            pass


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


class RaisingNvtx:
    """An nvtx package that raises: at the start of a range, or at its end."""

    def __init__(self, at: str) -> None:
        self.at = at

    def start_range(self, message: str | None = None, domain: str | None = None) -> object:
        if self.at == "start":
            raise RuntimeError("nvtx broke at the start")
        return 1

    def end_range(self, range_id: object) -> None:
        if self.at == "end":
            raise RuntimeError("nvtx broke at the end")


@pytest.mark.parametrize("at", ["start", "end"])
def test_a_raising_nvtx_never_changes_what_the_program_does(
    at: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The block runs and its own exception and result come out as without NVTX; the failure
    is logged, once."""
    monkeypatch.setattr(_hooks, "nvtx", RaisingNvtx(at))

    @ais.record_function("decorated")
    def double(x: int) -> int:
        return 2 * x

    ran = []
    for _ in range(3):
        with ais.record_function("plain"):
            ran.append(1)
    assert double(21) == 42
    with pytest.raises(KeyError, match="the user's"):
        with ais.record_function("raising"):
            raise KeyError("the user's")
    assert ran == [1, 1, 1]
    said = [r for r in caplog.records if "nvtx failed" in r.getMessage()]
    assert len(said) == 1 and f"{at}_range" in said[0].getMessage()
