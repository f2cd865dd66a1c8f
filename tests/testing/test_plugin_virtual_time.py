"""The pytest plugin's virtual_time and the race detector's clock: what runs on the fake
clock and what cannot, told through pytester's inner sessions."""

from __future__ import annotations

import fnmatch

import pytest

from tests.helpers.plugin_runs import run


@pytest.mark.timeout(120)  # the fault: the inner run hung until killed
def test_an_async_fixture_awaiting_device_work_under_virtual_time_fails_at_once(
    pytester: pytest.Pytester,
) -> None:
    """virtual_time's clock runs in the test function only: an async fixture (anyio's or
    pytest-asyncio's) that awaits device work before or after it gets an error saying so at
    once, not a hang; work it submits and the test awaits runs; awaiting completed work in
    teardown is fine."""
    result = run(
        pytester,
        """
import aiostream as ais
import pytest
import pytest_asyncio
import trio.testing

held = {}

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):  # trio: async fixtures run before the plugin can give a clock
    if request.param == "trio":
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})
    return "asyncio"

@pytest.fixture
async def warmed(virtual_time):
    s = ais.Stream()
    ais.delay(0.01, stream=s)
    await s.synchronize()  # before the test function: the clock stands still
    yield

@pytest.fixture
async def submitted(virtual_time):
    held["s"] = ais.Stream()
    ais.delay(0.01, stream=held["s"])  # submitted here, awaited in the test
    yield
    await held["s"].synchronize()  # complete by now: nothing to wait for
    del held["s"]

@pytest_asyncio.fixture
async def warmed_asyncio(virtual_time):
    s = ais.Stream()
    ais.delay(0.01, stream=s)
    await s.synchronize()
    yield

@pytest.mark.anyio
async def test_anyio_fixture(warmed, anyio_backend):
    pass

@pytest.mark.anyio
async def test_submitted_in_the_fixture(submitted, virtual_time, anyio_backend):
    await held["s"].synchronize()
    assert virtual_time.now() == 0.01

@pytest.mark.asyncio
async def test_asyncio_fixture(warmed_asyncio):
    pass
""",
        "-q",
    )
    # each failing fixture: its error at setup, and nothing more (no leak check of a test
    # that never ran)
    result.assert_outcomes(passed=2, errors=3)
    result.stdout.no_fnmatch_line("*leaked*")
    # the traceback's lines only: the short summary's copies are cut to the terminal's width
    said = "E *AiostreamError: this wait would never end: virtual_time's clock runs only while*"
    assert len([line for line in result.outlines if fnmatch.fnmatch(line, said)]) == 3


@pytest.mark.timeout(120)  # the fault: the inner run hung until killed
def test_a_wait_pending_when_the_test_function_ends_fails_in_teardown(
    pytester: pytest.Pytester,
) -> None:
    """A task that a fixture keeps begins a wait in the test function, which ends before the
    work does: the clock stops with the wait pending, and the fixture's teardown, waiting for
    the task, gets the error saying why at once (pytest-asyncio's task; anyio's task group on
    asyncio and trio), not a hang."""
    result = run(
        pytester,
        """
import asyncio
import aiostream as ais
import anyio
import pytest
import pytest_asyncio
import trio.testing

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    if request.param == "trio":
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})
    return "asyncio"

def start_wait():
    s = ais.Stream()
    ais.delay(10.0, stream=s)
    return s

@pytest_asyncio.fixture
async def kept(virtual_time):
    box = {}
    yield box
    await box["task"]  # a wait begun in the test function

@pytest.fixture
async def group(virtual_time):
    async with anyio.create_task_group() as tg:
        yield tg  # the group's tasks are awaited at teardown

@pytest.mark.asyncio
async def test_asyncio_task(kept):
    kept["task"] = asyncio.ensure_future(start_wait().synchronize())
    while not ais.pending_waits():  # until the wait has begun
        await asyncio.sleep(0)

@pytest.mark.anyio
async def test_task_group(group, anyio_backend):
    group.start_soon(start_wait().synchronize)
    while not ais.pending_waits():  # until the wait has begun (trio starts tasks in any order)
        await anyio.lowlevel.checkpoint()
""",
        "-q",
    )
    result.assert_outcomes(passed=3, errors=3)
    # each error's exception group holds the wait's error (and the leak of its work)
    said = "*AiostreamError: this wait would never end: virtual_time's clock runs only while*"
    assert len([line for line in result.outlines if fnmatch.fnmatch(line, said)]) == 3


def test_a_read_before_the_copy_lands_is_a_race_on_the_devices_clock(
    pytester: pytest.Pytester,
) -> None:
    """When the detector sees a read before the copy's await, as README says: always under
    virtual_time (the clock waits for the await); under virtual_device alone (real time),
    while the copy's simulated time has not passed (a slow copy), and not once it has."""
    result = run(
        pytester,
        """
import time
import aiostream as ais
import pytest

def read_before_awaiting(after_s=0.0):
    dev, host = ais.DeviceBuffer(64), ais.HostBuffer(64)
    ais.copy_async(host, dev)
    time.sleep(after_s)
    host.numpy()  # before any await of the copy
    return dev, host

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_virtual_time(virtual_time, anyio_backend):
    kept = read_before_awaiting(after_s=0.05)  # real time passes; the device's clock does not
    await ais.current_stream().synchronize()

@pytest.mark.aiostream(latency=1.0)
def test_real_time_slow_copy(virtual_device):
    kept = read_before_awaiting()  # 1 s of simulated copy: in flight
    ais.current_stream().synchronize_blocking()

def test_real_time_copy_landed(virtual_device):
    kept = read_before_awaiting(after_s=0.05)  # 10 us of simulated copy: landed
    ais.current_stream().synchronize_blocking()
""",
        "-q",
    )
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_virtual_time*"])
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_real_time_slow_copy*"])
    result.stdout.no_fnmatch_line("*ERROR at teardown of test_real_time_copy_landed*")


def test_virtual_time_asked_for_too_late_says_how_to_ask(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
import pytest

@pytest.mark.anyio
async def test_late(request, anyio_backend):
    request.getfixturevalue("virtual_time")
""",
        "-q",
    )
    result.assert_outcomes(failed=2)  # on asyncio and trio
    result.stdout.fnmatch_lines(
        ["*virtual_time runs the test function itself on a fake clock*getfixturevalue()*"]
    )
    result.stdout.no_fnmatch_line("*KeyError*")
