"""Fixtures shared by the test suite: every loop and a fresh simulator.

Every backend comes from the plugin's own `aiostream_device` fixture (aiostream.testing).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import hypothesis  # noqa: F401 - imported before the freeze below: see _settle
import pytest

pytest_plugins = ["pytester"]

import aiostream as ais  # noqa: E402 - after the plugin list, as pytest reads it

ROOT = Path(__file__).resolve().parent.parent


def run_python(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` from the checkout, with ``env`` added and no AIOSTREAM_DEVICE."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    environ.pop("AIOSTREAM_DEVICE", None)
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=environ,
    )


def in_spawned_process(target: Callable[..., None], *args: object) -> tuple[int, Any]:
    """Run ``target(*args, out)`` in a fresh (spawned) process; return its pid and what it put
    on ``out`` (a queue), once."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, out))
    child.start()
    try:
        return child.pid or 0, out.get(timeout=60)
    finally:
        child.join(timeout=60)


def import_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` by its name, as the examples import each other (and as
    Ray's workers import an actor's module): examples/ goes on ``sys.path``."""
    path = str(ROOT / "examples")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def _settle() -> None:
    """Collect, then move every object alive into the collector's permanent generation.

    The suite's own objects (modules, collected items, what a test file imported on first
    use) live as long as the session; once frozen, the collection each test's teardown makes
    (leak checks need it) costs what that test made, not what the session holds: 0.1-0.2 s
    a test otherwise. Hypothesis is imported first: its check that a PRNG registered at its
    import is referenced elsewhere cannot see frozen referrers.
    """
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    _settle()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _settle()  # a module's fixtures are gone: what is left lives on


_LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(
        ("asyncio", {"use_uvloop": True}),
        id="uvloop",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
        ),
    ),
    pytest.param(
        ("trio", {}),
        id="trio",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("trio") is None, reason="trio is not installed"
        ),
    ),
]


@pytest.fixture(params=_LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict]:
    """Run each async test on asyncio, asyncio with uvloop, and trio."""
    return request.param


@pytest.fixture(autouse=True)
def fresh_virtual() -> Iterator[None]:
    """Each test starts on a fresh virtual backend (real time, one device), the default device.

    Tests of other backends name their device (see ``aiostream_device``), so the suite runs the
    same on machines with and without a GPU.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIOSTREAM_DEVICE", "virtual")
        ais.virtual.reset()
        yield
        gc.collect()
        ais.virtual.reset()


@pytest.fixture
def clock() -> ais.virtual.VirtualClock:
    """A manual clock driving a fresh virtual backend."""
    clk = ais.virtual.VirtualClock()
    ais.virtual.reset(clock=clk)
    return clk


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
