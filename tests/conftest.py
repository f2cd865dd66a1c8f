"""The suite's lanes, and the fixtures every test shares: every loop and a fresh simulator.

Lanes (README, "Tests"): ``pytest`` runs the fast lane, every test not marked ``slow``;
``--run-slow`` adds those, and gives property tests their full number of examples (a tenth
in the fast lane: ``tests/helpers/lanes.py``). Tests marked ``cuda`` (and every test
parametrized on a ``cuda:`` device) need a CUDA driver: where none works they skip, saying
why; CI runs them with the stand-in driver of ``tests/fake_cuda`` (``pytest -m cuda
--require-cuda``). Helpers live in ``tests/helpers/``, never here.

Every backend comes from the plugin's own ``aiostream_device`` fixture (aiostream.testing).
"""

from __future__ import annotations

import collections
import gc
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis  # noqa: F401 - imported before the freeze below: see _settle
import pytest

pytest_plugins = ["pytester"]

import aiostream as ais  # noqa: E402 - after the plugin list, as pytest reads it
from tests.helpers import fake_cuda, lanes, stand_in  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aiostream's suite")
    group.addoption(
        "--run-slow",
        action="store_true",
        help="also run the tests marked slow: whole programs, benchmarks' smoke runs, scale "
        "(CI's full lane)",
    )
    group.addoption(
        "--max-skips",
        type=int,
        default=None,
        metavar="N",
        help="fail the run when more than N tests skipped (CI's lane that sees the stand-in "
        "as a GPU: only fault injection and two-device tests may skip there)",
    )
    group.addoption(
        "--require-cuda",
        action="store_true",
        help="stop at once where CUDA does not work, instead of skipping the cuda tests "
        "(CI's CUDA lane, on the stand-in driver)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "slow: a whole program, a benchmark's smoke run or a test at scale; runs with --run-slow",
    )
    config.addinivalue_line(
        "markers",
        "stand_in(why): uses the stand-in driver's test hooks (why: what for, such as fault "
        "injection at a chosen call); skips on other drivers, a GPU among them",
    )
    lanes.full = config.getoption("run_slow")
    if config.getoption("require_cuda") and not stand_in.OK:
        raise pytest.UsageError(f"--require-cuda: CUDA does not work here: {stand_in.REASON}")


def _on_cuda(item: pytest.Item) -> bool:
    if item.get_closest_marker("cuda") or item.get_closest_marker("stand_in"):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(isinstance(v, str) and v.startswith("cuda") for v in params.values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason=stand_in.NO_CUDA)
    for item in items:
        if _on_cuda(item):
            item.add_marker(pytest.mark.cuda)
            hooks = item.get_closest_marker("stand_in")
            if not stand_in.OK:
                item.add_marker(no_cuda)
            elif hooks is not None and stand_in.FAKE is None:
                why = hooks.args[0] if hooks.args else "its checks"
                item.add_marker(
                    pytest.mark.skip(reason=f"needs the stand-in driver's hooks: {why}")
                )
    if not config.getoption("run_slow"):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_report_header(config: pytest.Config) -> str:
    lane = "fast and slow" if config.getoption("run_slow") else "fast (slow tests: --run-slow)"
    cuda = (
        "the stand-in driver"
        if stand_in.FAKE is not None
        else ("a CUDA driver" if stand_in.OK else "none (the cuda tests skip)")
    )
    return f"aiostream's suite: lanes {lane}; CUDA: {cuda}"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The skips counted by reason (not by file and line, as ``-rs`` does), and the
    ``--max-skips`` verdict."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter(_skip_reason(r) for r in skipped)
    terminalreporter.section("skips by reason")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:6d}  {reason}")
    limit = config.getoption("max_skips")
    if limit is not None and len(skipped) > limit:
        terminalreporter.write_line(
            f"--max-skips {limit}: {len(skipped)} tests skipped; the run fails", red=True
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    limit = session.config.getoption("max_skips")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if limit is None or reporter is None:
        return
    if len(reporter.stats.get("skipped", [])) > limit and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


@pytest.fixture(scope="session")
def stand_in_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the stand-in libcuda.so.1, built for this session."""
    if fake_cuda.compiler() is None:
        pytest.skip("needs a C compiler (cc or gcc) to build the stand-in driver")
    return fake_cuda.build(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture
def clock() -> ais.virtual.VirtualClock:
    """A manual clock driving a fresh virtual backend."""
    clk = ais.virtual.VirtualClock()
    ais.virtual.reset(clock=clk)
    return clk
